"""Patch sets: the model (`patch_set`: sets, pieces, capabilities), the registry of every set
(`registry`), the shape checks (`shape`), the default release without a tree (`default_release`), and
the modules of sets (imported only when one of their sets is used). `files/` holds the helpers added verbatim to trees.
"""

from __future__ import annotations

from rl_msprobe.patches.patch_set import (
    Capability,
    CapabilityError,
    EntryPoint,
    NewFile,
    PatchSet,
    Piece,
    Probe,
    defines_class,
    where_present,
)
from rl_msprobe.patches.registry import (
    ROWS,
    SetRow,
    all_sets,
    entry_point_started_by,
    entry_points,
    find_set,
    get_entry_point,
    get_set,
    project_of,
    resolve_sets,
    set_names,
)

__all__ = [
    "ROWS",
    "Capability",
    "CapabilityError",
    "EntryPoint",
    "NewFile",
    "PatchSet",
    "Piece",
    "Probe",
    "SetRow",
    "all_sets",
    "defines_class",
    "entry_point_started_by",
    "entry_points",
    "find_set",
    "get_entry_point",
    "get_set",
    "project_of",
    "resolve_sets",
    "set_names",
    "where_present",
]

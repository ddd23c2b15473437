"""Patch sets: the model (`patch_set`: sets, pieces, capabilities), the registry of every set
(`registry`), the shape checks (`shape`), the default release without a tree (`default_release`), and
one module of sets per upstream project. `files/` holds the helpers added verbatim to trees.
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
    SETS,
    all_sets,
    entry_point_started_by,
    entry_points,
    get_entry_point,
    get_set,
    resolve_sets,
)

__all__ = [
    "SETS",
    "Capability",
    "CapabilityError",
    "EntryPoint",
    "NewFile",
    "PatchSet",
    "Piece",
    "Probe",
    "all_sets",
    "defines_class",
    "entry_point_started_by",
    "entry_points",
    "get_entry_point",
    "get_set",
    "resolve_sets",
    "where_present",
]

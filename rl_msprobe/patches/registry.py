"""Every patch set, in the order `patch list` shows them: one explicit table of rows, no import order.

A row names the set, its project and the module that defines it; the module (with its codemods and
whatever they import, `libcst.matchers` included) is imported only when the set is used, so
`patch status verl-engine` loads verl-engine's codemods and no other set's. A new set is one row
here plus its module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_msprobe.errors import UserError

if TYPE_CHECKING:
    from rl_msprobe.patches.patch_set import EntryPoint, PatchSet


@dataclass(frozen=True)
class SetRow:
    """One patch set: `module` (under rl_msprobe.patches) holds it in its `SETS` table."""

    name: str
    project: str
    module: str

    def load(self) -> PatchSet:
        sets = importlib.import_module(f"rl_msprobe.patches.{self.module}").SETS
        found: PatchSet | None = next((s for s in sets if s.name == self.name), None)
        if found is None or found.project != self.project:
            raise ValueError(f"patches/{self.module}.py has no {self.project} set {self.name!r} in its SETS")
        return found


ROWS: tuple[SetRow, ...] = (
    SetRow("verl-engine", "verl", "verl"),
    SetRow("verl-prompts-only", "verl", "verl_consistency"),
    SetRow("verl-request-id", "verl", "verl_consistency"),
    SetRow("verl-consistency", "verl", "verl_consistency"),
    SetRow("verl-triage", "verl", "verl_triage"),
    SetRow("verl-weights", "verl", "verl_weights"),
    SetRow("verl-routing", "verl", "verl_routing"),
    SetRow("sglang-weights", "sglang", "verl_weights"),
    SetRow("sglang-dump", "sglang", "sglang"),
    SetRow("sglang-dispatch-log", "sglang", "sglang"),
    SetRow("sglang-pd-dump-path", "sglang", "sglang"),
    SetRow("sglang-bootstrap-room", "sglang", "sglang"),
    SetRow("vllm-ascend-dispatch-log", "vllm-ascend", "vllm_ascend"),
    SetRow("vllm-dump", "vllm", "vllm"),
)

if len({row.name for row in ROWS}) != len(ROWS):
    raise ValueError(f"patch set names must be unique: {[row.name for row in ROWS]}")
_LOADED: dict[str, PatchSet] = {}


def _rows() -> dict[str, SetRow]:
    """name -> row, read from ROWS at each call (a row is the only thing a new set adds here)."""
    return {row.name: row for row in ROWS}


def set_names(project: str | None = None) -> list[str]:
    """Every set's name (of `project` only, when given), in list order, without importing any set."""
    return [row.name for row in ROWS if project is None or row.project == project]


def entry_points(project: str) -> list[EntryPoint]:
    """What jobs of `project` run (`patch apply --for NAME`); a project without any has one path."""
    if project != "verl":
        return []
    from rl_msprobe.patches.verl_entry_points import ENTRY_POINTS

    return list(ENTRY_POINTS)


def get_entry_point(project: str, name: str) -> EntryPoint:
    """The entry point `name` of `project` (`patch apply --for NAME`), or a UserError listing them."""
    for entry in entry_points(project):
        if entry.name == name:
            return entry
    known = ", ".join(e.name for e in entry_points(project)) or "none"
    raise UserError(f"--for {name}: {project} has no entry point {name!r}; known: {known}.")


def entry_point_started_by(project: str, entry: str) -> EntryPoint | None:
    """The entry point a launch script's command (`verl.trainer.main_ppo`) starts, None when unknown
    (a recipe's own main: rl-msprobe cannot tell which trainer it runs)."""
    return next((e for e in entry_points(project) if e.started_by(entry)), None)


def all_sets(project: str | None = None) -> list[PatchSet]:
    """Every set (of `project` only, when given), loaded: imports their modules."""
    return [get_set(name) for name in set_names(project)]


def find_set(name: str) -> PatchSet | None:
    """The set `name`, or None when this rl-msprobe has none by that name (a tree's record may name
    a set of another version)."""
    row = _rows().get(name)
    if row is None:
        return None
    if name not in _LOADED:
        _LOADED[name] = row.load()
    return _LOADED[name]


def project_of(name: str) -> str:
    """The project set `name` patches, read from its row (its module is not imported)."""
    rows = _rows()
    if name not in rows:
        get_set(name)  # the UserError listing the known sets
    return rows[name].project


def get_set(name: str) -> PatchSet:
    found = find_set(name)
    if found is None:
        known = ", ".join(sorted(_rows()))
        raise UserError(f"unknown patch set {name!r}; known sets: {known} (see `rl-msprobe patch list`).")
    return found


def resolve_sets(names: list[str] | tuple[str, ...]) -> list[PatchSet]:
    """The sets named on the command line; all for one project."""
    if not names:
        raise UserError("name at least one patch set (see `rl-msprobe patch list`).")
    rows = _rows()
    unknown = [n for n in names if n not in rows]
    if unknown:
        get_set(unknown[0])
    projects = {rows[n].project for n in names}
    if len(projects) > 1:
        raise UserError(
            f"sets {', '.join(dict.fromkeys(names))} are for different projects ({', '.join(sorted(projects))}); "
            "patch one tree at a time."
        )
    return [get_set(n) for n in dict.fromkeys(names)]

"""Every patch set, in the order `patch list` shows them: one explicit table, no import order.

A new set module adds its `SETS` here.
"""

from __future__ import annotations

from rl_msprobe.errors import UserError
from rl_msprobe.patches import sglang, verl, verl_triage, verl_weights, vllm, vllm_ascend
from rl_msprobe.patches.patch_set import EntryPoint, PatchSet

SETS: tuple[PatchSet, ...] = (
    *verl.SETS,
    *verl_triage.SETS,
    *verl_weights.SETS,
    *sglang.SETS,
    *vllm_ascend.SETS,
    *vllm.SETS,
)

_BY_NAME = {s.name: s for s in SETS}
if len(_BY_NAME) != len(SETS):
    raise ValueError(f"patch set names must be unique: {[s.name for s in SETS]}")


# what jobs of each project run (`patch apply --for NAME`); a project without any has one path
ENTRY_POINTS: tuple[EntryPoint, ...] = verl.ENTRY_POINTS


def entry_points(project: str) -> list[EntryPoint]:
    return [e for e in ENTRY_POINTS if e.project == project]


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


def all_sets() -> list[PatchSet]:
    return list(SETS)


def get_set(name: str) -> PatchSet:
    try:
        return _BY_NAME[name]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise UserError(
            f"unknown patch set {name!r}; known sets: {known} (see `rl-msprobe patch list`)."
        ) from None


def resolve_sets(names: list[str] | tuple[str, ...]) -> list[PatchSet]:
    """The sets named on the command line; all for one project."""
    if not names:
        raise UserError("name at least one patch set (see `rl-msprobe patch list`).")
    sets = [get_set(n) for n in dict.fromkeys(names)]
    projects = {s.project for s in sets}
    if len(projects) > 1:
        raise UserError(
            f"sets {', '.join(s.name for s in sets)} are for different projects ({', '.join(sorted(projects))}); "
            "patch one tree at a time."
        )
    return sets

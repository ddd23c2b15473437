"""Which trees and sets one `patch` command means: SET names, --tree and --python made into
(target, sets) groups, callable from Python without click."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_msprobe.patches.patch_set import PatchSet
    from rl_msprobe.upstream.trees import Target


def target_and_sets(
    set_names: tuple[str, ...], tree: str | None, python: str | None
) -> tuple[Target, list[PatchSet]]:
    """The one tree of the sets' project (--tree, --python, else the first set's default release)."""
    from rl_msprobe.patches import resolve_sets
    from rl_msprobe.patches.default_release import default_release
    from rl_msprobe.upstream.trees import resolve_target

    sets = resolve_sets(set_names)
    default = default_release(sets[0]) if not tree and not python else None  # one project per call
    return resolve_target(tree, python, sets[0].project, default_version=default), sets


def groups(
    set_names: tuple[str, ...], tree: str | None, python: str | None
) -> list[tuple[Target, list[PatchSet]]]:
    """(target, sets) per tree: with --python (and no --tree) one per project, in the order named, since
    one interpreter imports every project's tree; else the one tree of `target_and_sets`."""
    from rl_msprobe.patches import get_set

    if not (set_names and python and not tree):
        return [target_and_sets(set_names, tree, python)]
    by_project: dict[str, list[str]] = {}
    for name in dict.fromkeys(set_names):
        by_project.setdefault(get_set(name).project, []).append(name)
    return [target_and_sets(tuple(names), None, python) for names in by_project.values()]


def status_groups(
    set_names: tuple[str, ...], tree: str | None, python: str | None
) -> list[tuple[Target, list[PatchSet]]]:
    """`patch status`'s groups: without SET, every top-level set of the --tree's project."""
    from rl_msprobe.errors import UserError
    from rl_msprobe.patches import all_sets
    from rl_msprobe.upstream.trees import resolve_tree

    if set_names:
        return groups(set_names, tree, python)
    if not tree or python:
        raise UserError(
            "without SET, pass --tree PATH (and not --python) so rl-msprobe can tell the project."
        )
    target = resolve_tree(tree)
    return [(target, [s for s in all_sets(target.project) if not s.includes])]

"""The engine's entry points over several trees, and the diff of a plan."""

from __future__ import annotations

from rl_msprobe.engine.diffs import unified_diff
from rl_msprobe.engine.multitree import each
from rl_msprobe.engine.plan_parts import Plan
from rl_msprobe.engine.results import ApplyResult, RevertResult
from rl_msprobe.engine.writer import apply, revert
from rl_msprobe.patches import PatchSet
from rl_msprobe.upstream.trees import Target

Groups = list[tuple[Target, list[PatchSet]]]


def diff(plan: Plan) -> str:
    """The unified diff of a plan (`git apply` and `patch -p1` take it)."""
    return unified_diff(plan.changes)


def apply_many(
    groups: Groups,
    branch: str | None = None,
    make_branch: bool = True,
    allow_dirty: bool = False,
    entry_point: str | None = None,
) -> list[ApplyResult]:
    """`apply` on each (tree, sets): every tree or none (trees done before a failure are taken back)."""
    return each(
        groups,
        lambda target, sets: apply(
            target, sets, branch, make_branch=make_branch, allow_dirty=allow_dirty, entry_point=entry_point
        ),
    )


def revert_many(groups: Groups) -> list[RevertResult]:
    """`revert` on each (tree, sets): every tree or none."""
    return each(groups, revert)

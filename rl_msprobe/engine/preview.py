"""`patch diff` as a library call: what applying sets would change in a tree, without writing.

`preview` returns a frozen `PatchDiff` (the plan, its unified diff and the diff's summary) with
its state as an enum, its own `--json` document (schema in docs/json.md) and its terminal text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_msprobe.engine.plan_parts import Plan
    from rl_msprobe.upstream.trees import Target

SCHEMA = "rl-msprobe.patch-diff/1"


class Pending(str, enum.Enum):
    """Whether applying the sets would change a file (`patch diff --exit-code` exits 1 on CHANGES)."""

    CHANGES = "changes"
    NONE = "none"  # applied already, native, or not applicable here


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


@dataclass(frozen=True)
class PatchDiff:
    """The plan of applying `plan.sets` to `target`, its unified diff and the diff's summary."""

    target: Target
    plan: Plan
    text: str
    summary: dict[str, Any]

    @property
    def pending(self) -> Pending:
        return Pending.CHANGES if self.plan.pending else Pending.NONE

    def to_json(self) -> dict[str, object]:
        plan = self.plan
        return {
            "schema": SCHEMA,
            "tree": str(self.target.root),
            "project": self.target.project,
            "version": self.target.version,
            "sets": [s.name for s in plan.sets],
            "tested": not plan.warnings,
            "warnings": plan.warnings,
            "capabilities": {
                name: [c.to_json() for c in reports] for name, reports in plan.capabilities.items()
            },
            "summary": self.summary,
            "skipped": [r.to_json() for r in plan.skipped],
            "not_covered": [m.to_json() for m in plan.not_covered if m.in_tree],
            "diff": self.text,
        }

    def stat_lines(self) -> list[str]:
        """`--stat`: one line per file (hunks, lines added and removed)."""
        return [
            f"{f['path']}: {_plural(f['hunks'], 'hunk')}, +{f['added']} -{f['removed']}"
            for f in self.summary["files"]
        ]

    def notes(self) -> list[str]:
        """What goes to stderr beside the diff: skipped pieces, gaps, warnings, then the summary."""
        out = [f"# {r.piece}: not applicable here: {r.detail}" for r in self.plan.skipped]
        out += [
            f"# NOT COVERED for {gap.entry_point}: {gap.piece}: {gap.reason}"
            for gap in self.plan.not_covered
            if gap.in_tree
        ]
        s = self.summary
        return [
            *out,
            *(f"warning: {w}" for w in self.plan.warnings),
            f"# {self.target.describe()}: {_plural(len(s['files']), 'file')}, "
            f"{_plural(s['hunks'], 'hunk')}, +{s['added']} -{s['removed']}",
        ]


def preview(set_names: tuple[str, ...], tree: str | None = None, python: str | None = None) -> PatchDiff:
    """What applying SET... to the tree (--tree, --python, else the default release) would change."""
    from rl_msprobe.engine.api import diff
    from rl_msprobe.engine.diffs import summarize
    from rl_msprobe.engine.plan import plan_apply
    from rl_msprobe.engine.selection import target_and_sets

    target, sets = target_and_sets(set_names, tree, python)
    plan = plan_apply(target, sets)
    text = diff(plan)
    return PatchDiff(target, plan, text, summarize(text))

"""The patch engine: plan -> diff -> apply / revert / status of patch sets on upstream trees.

Everything is computed in memory first (`plan_apply`, `plan_revert`); writing is one all-or-nothing
step per tree (lock, journal, then git branch and commit, or the files plus the originals and a
manifest), and `apply_many` / `revert_many` make a command over several trees all or nothing too.

- `plan_parts`: FileChange, PieceReport, Plan     - `plan`: plan_apply, plan_revert
- `diffs`: unified diffs and their summary       - `inspection`: status of sets and pieces
- `writer`: apply, revert                         - `multitree`: several trees, all or none
- `transaction`: one journaled write              - `recovery`: a killed run's journal, finished
- `journal`: lock + write-ahead journal           - `manifest`: originals outside git
- `git`: branch, commit, record of sets           - `tree`: git or not, state folder
- `gitenv`: git always in the tree's repository   - `gitstate`: operations in progress, hidden edits
- `results`: the frozen results (ApplyResult, RevertResult, TreeStatus, Recovered) and their JSON
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it; loaded on first use, so `engine.journal` (which the
# planner's output writer uses) never pulls in LibCST, GitPython or the patch sets
_PUBLIC = {
    "summarize": "diffs",
    "unified_diff": "diffs",
    "FileChange": "plan_parts",
    "PieceReport": "plan_parts",
    "Plan": "plan_parts",
    "each": "multitree",
    "plan_apply": "plan",
    "plan_revert": "plan",
    "ApplyResult": "results",
    "GitCommit": "results",
    "JournalOutcome": "results",
    "Recovered": "results",
    "RevertResult": "results",
    "SetStatus": "results",
    "TreeStatus": "results",
    "combined_json": "results",
    "combined_status_json": "results",
    "status": "inspection",
    "Transaction": "transaction",
    "apply": "writer",
    "revert": "writer",
    "diff": "api",
    "apply_many": "api",
    "revert_many": "api",
}

if TYPE_CHECKING:
    from rl_msprobe.engine.api import apply_many, diff, revert_many
    from rl_msprobe.engine.diffs import summarize, unified_diff
    from rl_msprobe.engine.inspection import status
    from rl_msprobe.engine.multitree import each
    from rl_msprobe.engine.plan import plan_apply, plan_revert
    from rl_msprobe.engine.plan_parts import FileChange, PieceReport, Plan
    from rl_msprobe.engine.results import (
        ApplyResult,
        GitCommit,
        JournalOutcome,
        Recovered,
        RevertResult,
        SetStatus,
        TreeStatus,
        combined_json,
        combined_status_json,
    )
    from rl_msprobe.engine.transaction import Transaction
    from rl_msprobe.engine.writer import apply, revert


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_msprobe.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_msprobe.engine.{module}"), name)


__all__ = [
    "ApplyResult",
    "FileChange",
    "GitCommit",
    "JournalOutcome",
    "PieceReport",
    "Plan",
    "Recovered",
    "RevertResult",
    "SetStatus",
    "Transaction",
    "TreeStatus",
    "apply",
    "apply_many",
    "combined_json",
    "combined_status_json",
    "diff",
    "each",
    "plan_apply",
    "plan_revert",
    "revert",
    "revert_many",
    "status",
    "summarize",
    "unified_diff",
]

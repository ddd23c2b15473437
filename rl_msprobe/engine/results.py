"""What the engine hands back: frozen results, each with the JSON document its command prints.

Commands render these; nobody edits them afterwards (a command over several trees combines the
documents with `combined_json`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rl_msprobe.codemods.base import Status
from rl_msprobe.engine.plan_parts import NotCovered, PieceReport
from rl_msprobe.patches.shape import CapabilityReport


class JournalOutcome(str, enum.Enum):
    """What became of a journal a killed run left behind."""

    COMPLETED = "completed"  # its commit was made: only the journal went
    ROLLED_BACK = "rolled back"  # every file, the index and the branch put back
    IN_PROGRESS = "in progress"  # another rl-msprobe holds the tree's lock now (status only)
    UNFINISHED = "unfinished"  # found, but could not be finished or undone (status only)


@dataclass(frozen=True)
class Recovered:
    """A killed run's journal, found and (when the lock could be taken) finished or undone first."""

    outcome: JournalOutcome
    op: str | None = None
    pid: int | str | None = None
    files: tuple[str, ...] = ()
    removed: str | None = None  # git's index.lock the killed run left, removed
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        if self.outcome is JournalOutcome.IN_PROGRESS:
            return {"outcome": self.outcome.value, "pid": self.pid}
        if self.outcome is JournalOutcome.UNFINISHED:
            return {"outcome": self.outcome.value, "detail": self.detail}
        return {
            "op": self.op,
            "pid": self.pid,
            "outcome": self.outcome.value,
            "files": list(self.files),
            **({"removed": self.removed} if self.removed else {}),
        }


@dataclass(frozen=True)
class GitCommit:
    """The commit an apply or revert made on a git tree, and the branch it is on."""

    branch: str | None
    commit: str
    from_branch: str | None = None  # apply: the branch the tree was on before


@dataclass(frozen=True)
class _Written:
    tree: str
    project: str
    version: str | None
    sets: tuple[str, ...]
    changed: tuple[str, ...]
    skipped: tuple[PieceReport, ...]
    kept: tuple[PieceReport, ...]
    git: GitCommit | None
    noop: bool
    tested: bool
    warnings: tuple[str, ...]
    recovered: Recovered | None
    notes: tuple[str, ...]  # why the tree is written as it is, then the sets' notes for this version

    def _head(self) -> dict[str, Any]:
        return {
            "tree": self.tree,
            "project": self.project,
            "version": self.version,
            "sets": list(self.sets),
            "changed": list(self.changed),
            "skipped": [r.to_json() for r in self.skipped],
            "kept": [{**r.to_json(), "set": r.set} for r in self.kept],
        }

    def _tail(self) -> dict[str, Any]:
        return {
            "noop": self.noop,
            "tested": self.tested,
            "warnings": list(self.warnings),
            "recovered": self.recovered.to_json() if self.recovered else None,
        }


@dataclass(frozen=True)
class ApplyResult(_Written):
    """`patch apply` on one tree."""

    manifest: str | None = None  # outside git: where the originals and the manifest are kept
    entry_point: str | None = None  # `--for`
    not_covered: tuple[NotCovered, ...] = ()  # code in the tree that no site covers, per entry point
    entry_points: dict[str, bool] = field(default_factory=dict)  # entry point -> every capability found
    not_in_tree: tuple[str, ...] = ()  # entry points whose main module the tree lacks (False above)

    def to_json(self) -> dict[str, Any]:
        git = (
            {"branch": self.git.branch, "commit": self.git.commit, "from_branch": self.git.from_branch}
            if self.git
            else None
        )
        return {
            **self._head(),
            "git": git,
            **self._tail(),
            **({"manifest": self.manifest} if self.manifest else {}),
            "entry_point": self.entry_point,
            "not_covered": [m.to_json() for m in self.not_covered],
            "entry_points": dict(self.entry_points),
            "not_in_tree": list(self.not_in_tree),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RevertResult(_Written):
    """`patch revert` on one tree."""

    def to_json(self) -> dict[str, Any]:
        git = {"branch": self.git.branch, "commit": self.git.commit} if self.git else None
        return {**self._head(), "git": git, **self._tail(), "notes": list(self.notes)}


@dataclass(frozen=True)
class SetStatus:
    """One set in one tree: its status, each piece's, the capabilities found, its notes."""

    name: str
    status: Status
    files: tuple[PieceReport, ...]
    capabilities: tuple[CapabilityReport, ...]
    notes: tuple[str, ...]
    not_covered: tuple[NotCovered, ...] = ()  # code in the tree that no site covers, per entry point
    entry_points: dict[str, bool] = field(default_factory=dict)  # entry point -> every capability found
    not_in_tree: tuple[str, ...] = ()  # entry points whose main module the tree lacks (False above)

    @property
    def applied(self) -> bool:
        return self.status in (Status.APPLIED, Status.NATIVE)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "files": [r.to_json() for r in self.files],
            "capabilities": [c.to_json() for c in self.capabilities],
            "not_covered": [m.to_json() for m in self.not_covered],
            "entry_points": dict(self.entry_points),
            "not_in_tree": list(self.not_in_tree),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class TreeStatus:
    """`patch status` on one tree."""

    tree: str
    project: str
    version: str | None
    tested: bool
    warnings: tuple[str, ...]
    sets: tuple[SetStatus, ...]
    journal: Recovered | None = None

    @property
    def all_applied(self) -> bool:
        return all(s.applied for s in self.sets)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "tree": self.tree,
            "project": self.project,
            "version": self.version,
            "tested": self.tested,
            "warnings": list(self.warnings),
            "sets": [s.to_json() for s in self.sets],
        }
        if self.journal:
            doc["journal"] = self.journal.to_json()
        return doc


SCHEMAS = {  # the `patch apply | revert | status --json` documents (docs/json.md)
    "apply": "rl-msprobe.patch-apply/1",
    "revert": "rl-msprobe.patch-revert/1",
    "status": "rl-msprobe.patch-status/1",
}


def combined_json(results: list[ApplyResult] | list[RevertResult]) -> dict[str, Any]:
    """One JSON document: a single tree's as it is, several under "trees" (as `patch status` does)."""
    schema = {"schema": SCHEMAS["revert" if results and isinstance(results[0], RevertResult) else "apply"]}
    docs = [r.to_json() for r in results]
    if len(docs) == 1:
        return {**schema, **docs[0]}
    sets = [s for d in docs for s in d["sets"]]
    return {**schema, "trees": docs, "sets": sets, "noop": all(d["noop"] for d in docs)}


def combined_status_json(statuses: list[TreeStatus]) -> dict[str, Any]:
    schema = {"schema": SCHEMAS["status"]}
    docs = [s.to_json() for s in statuses]
    one = docs[0] if len(docs) == 1 else {"trees": docs, "sets": [s for d in docs for s in d["sets"]]}
    return {**schema, **one}

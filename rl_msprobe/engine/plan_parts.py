"""What a patch plan is made of: file changes, per-piece reports, the plan itself (all in memory)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rl_msprobe.codemods.base import Status
from rl_msprobe.patches import PatchSet, shape
from rl_msprobe.upstream.trees import Target


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the tree root, posix
    before: bytes | None  # None: the file does not exist yet
    after: bytes | None  # None: the file is removed
    pieces: tuple[str, ...] = ()


@dataclass(frozen=True)
class PieceReport:
    set: str
    path: str
    piece: str
    status: Status
    detail: str = ""
    site: bool = True  # False: the tree lacks the piece's file or code, so it delivers no capability

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "codemod": self.piece, "status": self.status.value, "detail": self.detail}


@dataclass(frozen=True)
class NotCovered:
    """An entry point without a capability it needs: its piece has no site here (`in_tree`: the
    code is in the tree in a shape rl-msprobe does not know) or the tree lacks that code."""

    entry_point: str  # `patch apply --for` name
    set: str
    capability: str
    piece: str  # "" when the tree lacks the code
    path: str
    reason: str  # the anchor error (file, anchor, detected version, what was expected), or why absent
    in_tree: bool

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        head = f"{self.entry_point}: {self.set} capability '{self.capability}'"
        if self.in_tree:
            return f"{head} has no site: {self.piece}: {self.reason.rstrip('.')}"
        return f"{head}: not in this tree ({self.reason.rstrip('.')})"


@dataclass
class Plan:
    target: Target
    sets: list[PatchSet]
    changes: list[FileChange] = field(default_factory=list)
    skipped: list[PieceReport] = field(default_factory=list)  # not-applicable / native pieces
    kept: list[PieceReport] = field(default_factory=list)  # revert: pieces another applied set still uses
    capabilities: dict[str, list[shape.CapabilityReport]] = field(default_factory=dict)  # per set
    entry_point: str | None = None  # `--for`: refuse when a capability it needs has no site
    uncovered: list[PieceReport] = field(default_factory=list)  # pieces with no site: a guard line only
    not_covered: list[NotCovered] = field(default_factory=list)  # per entry point, what it lacks
    entry_points: dict[str, dict[str, bool]] = field(default_factory=dict)  # set -> entry point -> covered
    reverting: bool = False  # a revert plan searches no anchor: its warning says what it does instead

    @property
    def pending(self) -> bool:
        return bool(self.changes)

    @property
    def warnings(self) -> list[str]:
        tail = REVERT_TAIL if self.reverting else None
        return shape.untested_warnings(self.sets, self.target.version, tail)


REVERT_TAIL = (
    "revert removes only the marked lines and the files rl-msprobe added, so the version does not matter"
)

"""One journaled write: record it, do its steps, and on any failure put everything back.

A command over several trees (`engine.multitree`) collects the finished transactions, so it can
take them back when a later tree fails.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from rl_msprobe.engine import journal
from rl_msprobe.engine.recovery import undo
from rl_msprobe.engine.tree import Tree


def write_entries(entries: tuple[journal.Entry, ...] | list[journal.Entry]) -> None:
    """Replace every file by its bytes after, durably, one checkpoint per file."""
    for entry in entries:
        try:
            journal.write_file(entry.path, entry.after, durable=True, step=f"replace:{entry.label}")
        except OSError as exc:
            exc.filename = exc.filename or str(entry.path)  # a full disk's write() names no file: this one
            raise
        journal.checkpoint(f"write:{entry.label}")


@dataclass(frozen=True)
class Transaction:
    """An apply, revert or undo on one tree: its files (bytes before and after) and, on git, the
    journal's git record (branch, start, paths, message)."""

    tree: Tree
    op: str
    entries: tuple[journal.Entry, ...]
    git: dict[str, Any] | None = None

    def run(
        self,
        steps: Callable[[], Any] | None = None,
        hold: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> Any:
        """Journal first, then `steps` (default: write the files); any failure puts everything back
        (or leaves it to the next run). `hold`: a lock taken after the journal, before the first write,
        and kept until the steps are done or undone (on git, the index's). Returns what `steps`
        returns (on git: the commit made)."""
        journal.begin(self.tree.state, self.tree.root, self.op, list(self.entries), {"git": self.git})
        undone = False
        try:
            journal.checkpoint("journal")
            with hold() if hold is not None else nullcontext():
                try:
                    if steps is None:
                        write_entries(self.entries)
                    out = steps() if steps is not None else None
                except BaseException as exc:  # undone while the lock is still held
                    undone = True
                    out = self._undo(exc)
        except BaseException as exc:
            if undone:
                raise
            out = self._undo(exc)  # before the first write: the journal, or the lock not had
        else:
            if not undone:
                journal.finish(self.tree.state)
        finished = FINISHED.get()
        if finished is not None:
            finished.append(Finished(self, out if self.git else None))
        return out

    def _undo(self, exc: BaseException) -> Any:
        """Everything back (re-raising `exc`), or, interrupted after its commit, done: the commit."""
        if not undo(self.tree, exc):
            raise exc
        return self.git["commit"] if self.git else None


@dataclass(frozen=True)
class Finished:
    """A transaction that completed, and the commit it made (None: none)."""

    transaction: Transaction
    commit: str | None


# set by `multitree.each` while a command runs over several trees: each finished transaction lands here
FINISHED: ContextVar[list[Finished] | None] = ContextVar("rl_msprobe_finished", default=None)

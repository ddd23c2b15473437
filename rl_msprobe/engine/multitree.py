"""One `patch apply` / `patch revert` over several trees (`--python` with sets of several projects):
all trees or none.

Each tree is written as always (its own lock and journal, one at a time, so trees that share a state
folder, like one site-packages, never wait on each other). When a later tree fails, the trees already
done are taken back, newest first: on git the branch and commit go (or the branch is reset to where
it was), elsewhere the files, originals and manifest get their bytes from before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rl_msprobe.engine import git, journal
from rl_msprobe.engine.recovery import recover
from rl_msprobe.engine.transaction import FINISHED, Finished, Transaction
from rl_msprobe.engine.tree import where
from rl_msprobe.errors import UserError
from rl_msprobe.patches import PatchSet
from rl_msprobe.upstream.trees import Target

if TYPE_CHECKING:
    from git import Repo  # GitPython, imported at run time only where a tree is opened

R = TypeVar("R")
Operation = Callable[[Target, list[PatchSet]], R]


def each(groups: list[tuple[Target, list[PatchSet]]], operation: Operation[R]) -> list[R]:
    """`operation` on every (tree, sets) in order; if one fails, the trees done before are taken back."""
    done: list[Finished] = []
    token = FINISHED.set(done)
    results = []
    try:
        for target, sets in groups:
            results.append(operation(target, sets))
    except BaseException as exc:
        FINISHED.reset(token)
        if done:
            _take_back(done, exc, [target.describe() for target, _ in groups[: len(results)]])
        raise
    FINISHED.reset(token)
    return results


def _take_back(done: list[Finished], exc: BaseException, trees: list[str]) -> None:
    """Undo the finished operations, newest first; the error then says which trees were taken back."""
    for item in reversed(done):
        tree = item.transaction.tree
        try:
            with journal.tree_lock(tree.state):
                recover(tree)
                if item.commit:
                    assert tree.repo is not None, "the operation committed: its tree is in a git repository"
                    _uncommit(tree.repo, item.transaction.git or {}, item.commit)
                else:
                    _unwrite(item.transaction)
        except (OSError, UserError, git.git_error()) as err:
            raise UserError(
                f"{exc} Taking back what this command did before failed too ({err}): "
                f"{where(tree)} keeps that change; revert it with `rl-msprobe patch revert`."
            ) from exc
    if isinstance(exc, UserError):
        exc.args = (f"{exc.args[0]} Already done on {', '.join(trees)}: taken back, so nothing was changed.",)


def _uncommit(repo: Repo, info: dict[str, Any], commit: str) -> None:
    """The commit of this command goes: its new branch is dropped, or the current branch reset (--keep)."""
    if git.head_state(repo)[1] != commit:
        raise UserError(f"{repo.working_tree_dir}: HEAD moved past rl-msprobe's commit {commit[:12]}")
    if info.get("branch"):
        git.leave_branch(repo, info)
        git.call(repo, "branch", "-D", info["branch"])
    else:
        git.call(repo, "reset", "-q", "--keep", info["from_head"])


def _unwrite(done: Transaction) -> None:
    """Outside git (or files git does not track): every file back to its bytes before, journaled too."""
    for entry in done.entries:
        if journal.sha(journal.read(entry.path)) != journal.sha(entry.after):
            raise UserError(f"{entry.path}: changed since rl-msprobe wrote it")
    back = tuple(journal.Entry(e.path, e.after, e.before, e.label) for e in reversed(done.entries))
    Transaction(done.tree, "undo", back).run()

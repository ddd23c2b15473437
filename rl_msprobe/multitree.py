"""One `patch apply` / `patch revert` over several trees (`--python` with sets of several projects):
all trees or none.

Each tree is written as always (its own lock and journal, one at a time, so trees that share a state
folder, like one site-packages, never wait on each other). When a later tree fails, the trees already
done are taken back, newest first: on git the branch and commit go (or the branch is reset to where
it was), elsewhere the files, originals and manifest get their bytes from before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_msprobe import journal
from rl_msprobe.errors import UserError
from rl_msprobe.patches import PatchSet
from rl_msprobe.targets import Target
from rl_msprobe.writer import DONE, Done, _git_error, _recover, _run, _write_entries, leave_branch

Operation = Callable[[Target, list[PatchSet]], dict[str, Any]]


def each(groups: list[tuple[Target, list[PatchSet]]], operation: Operation) -> list[dict[str, Any]]:
    """`operation` on every (tree, sets) in order; if one fails, the trees done before are taken back."""
    done: list[Done] = []
    token = DONE.set(done)
    results = []
    try:
        for target, sets in groups:
            results.append(operation(target, sets))
    except BaseException as exc:
        DONE.reset(token)
        if done:
            _take_back(done, exc, [target.describe() for target, _ in groups[: len(results)]])
        raise
    DONE.reset(token)
    return results


def _take_back(done: list[Done], exc: BaseException, trees: list[str]) -> None:
    """Undo the finished operations, newest first; the error then says which trees were taken back."""
    for item in reversed(done):
        try:
            with journal.tree_lock(item.tree.state):
                _recover(item.tree)
                if item.git and item.git.get("commit"):
                    _uncommit(item.tree.repo, item.git)
                else:
                    _unwrite(item)
        except (OSError, UserError, _git_error()) as err:
            raise UserError(
                f"{exc} Taking back what this command did before failed too ({err}): "
                f"{_where(item)} keeps that change; revert it with `rl-msprobe patch revert`."
            ) from exc
    if isinstance(exc, UserError):
        exc.args = (f"{exc.args[0]} Already done on {', '.join(trees)}: taken back, so nothing was changed.",)


def _where(item: Done) -> str:
    return str(item.tree.repo.working_tree_dir) if item.tree.repo is not None else str(item.tree.state.parent)


def _uncommit(repo: Any, info: dict[str, Any]) -> None:
    """The commit of this command goes: its new branch is dropped, or the current branch reset (--keep)."""
    if repo.head.commit.hexsha != info["commit"]:
        raise UserError(f"{repo.working_tree_dir}: HEAD moved past rl-msprobe's commit {info['commit'][:12]}")
    if info.get("branch"):
        leave_branch(repo, info)
        repo.git.branch("-D", info["branch"])
    else:
        repo.git.reset("-q", "--keep", info["from_head"])


def _unwrite(item: Done) -> None:
    """Outside git (or files git does not track): every file back to its bytes before, journaled too."""
    for entry in item.entries:
        if journal.sha(journal.read(entry.path)) != journal.sha(entry.after):
            raise UserError(f"{entry.path}: changed since rl-msprobe wrote it")
    back = [journal.Entry(e.path, e.after, e.before, e.label) for e in reversed(item.entries)]
    _run(item.tree, "undo", back, {"git": None}, lambda: _write_entries(back))

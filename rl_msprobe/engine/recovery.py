"""A run killed part-way left its journal: finish it when its commit was made, else put every file,
the index and the branch back. Apply, revert and status all start here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_msprobe.engine import git, journal
from rl_msprobe.engine.results import JournalOutcome, Recovered
from rl_msprobe.engine.tree import Tree, open_tree
from rl_msprobe.errors import UserError
from rl_msprobe.upstream.trees import Target


def recover(tree: Tree) -> Recovered | None:
    """An unfinished journal: complete it when its commit was made, else put every file back."""
    doc = journal.load(tree.state)
    if doc is None:
        return None
    info = doc.get("git")
    cleared = git.clear_index_lock(tree.repo, float(doc.get("started", 0))) if tree.repo is not None else None
    if info and tree.repo is not None and git.committed(tree.repo, info):
        if info.get("v") == 2:
            git.publish(tree.repo, info)
        outcome = JournalOutcome.COMPLETED
    else:
        try:
            roll_back(tree, doc)
        except (OSError, git.git_error()) as exc:
            raise UserError(
                f"an interrupted rl-msprobe {doc['op']} (pid {doc['pid']}) could not be undone ({exc}); "
                f"fix that and run again (journal in {tree.state / journal.JOURNAL})."
            ) from exc
        outcome = JournalOutcome.ROLLED_BACK
    journal.finish(tree.state)
    return Recovered(outcome, doc["op"], doc["pid"], tuple(f["label"] for f in doc["files"]), removed=cleared)


def roll_back(tree: Tree, doc: dict[str, Any]) -> None:
    """Files, index and branch back to how the journal found them."""
    journal.roll_back_files(tree.state, tree.root, doc)
    info = doc.get("git")
    repo = tree.repo
    if not info or repo is None or info.get("v") == 2:
        return  # the commit is made as objects and the ref moved last: nothing of git to take back
    # a journal of an older rl-msprobe: it staged in the index and checked out its branch first
    if info["paths"]:
        git.call(repo, "reset", "-q", "--", *info["paths"])
    name = info.get("branch")
    if not name or not git.branch_exists(repo, name):
        return
    if git.rev(repo, f"refs/heads/{name}") != info["from_head"]:
        raise UserError(  # commits on it since (the user's): checking out the old branch would hide them
            f"branch {name} has commits since the interrupted rl-msprobe {doc['op']}; rl-msprobe leaves it as "
            f"it is. Check it by hand (git log {name}), then remove {tree.state / journal.JOURNAL}."
        )
    if git.head_state(repo)[0] == name:
        git.leave_branch(repo, info)
    git.call(repo, "branch", "-D", name)


def undo(tree: Tree, exc: BaseException) -> bool:
    """The operation failed part-way (an error, or Ctrl-C): put everything back now, or leave the journal
    for the next run. True when its commit had been made after all: then it is finished, not undone
    (the caller ends as done)."""
    doc = journal.load(tree.state)
    try:
        if doc is not None:
            info = doc.get("git")
            if info and tree.repo is not None and info.get("v") == 2 and git.committed(tree.repo, info):
                git.publish(tree.repo, info)
                journal.finish(tree.state)
                return True
            roll_back(tree, doc)
            journal.finish(tree.state)
    except (OSError, UserError, git.git_error()) as err:
        raise UserError(
            f"{why(exc)}, and undoing it failed too ({why(err)}). The tree is recorded in "
            f"{tree.state / journal.JOURNAL}: the next rl-msprobe command on it finishes undoing it."
        ) from exc
    if isinstance(exc, (OSError, git.git_error())):
        raise UserError(f"{why(exc)}; every file was restored, nothing was changed.") from exc
    return False


def why(exc: BaseException) -> str:
    """An error in a few words: the file that could not be written, git's own message, or the text."""
    if isinstance(exc, OSError):
        return f"{exc.filename or 'a file'}: could not be written ({exc.strerror})"
    stderr = getattr(exc, "stderr", None)
    if stderr:
        return f"git failed: {git.one_line(str(stderr))}"
    return str(exc)


def recovery_for_status(target: Target) -> Recovered | None:
    """`status` finishes a killed run's journal when it can take the lock, and says so; else reports it."""
    if target.readonly:
        return None
    repo = git.open_repo(target.root)
    places = [target.root / journal.STATE_DIR, journal.cache_state_dir(target.root)]
    places += [Path(repo.git_dir) / "rl-msprobe"] if repo is not None else []
    if not any((p / journal.JOURNAL).exists() for p in places):
        return None  # the common case, without asking git anything more
    try:
        tree = open_tree(target, writing=False)
    except UserError:
        return None
    if not (tree.state / journal.JOURNAL / "journal.json").exists():
        return None
    try:
        with journal.tree_lock(tree.state, wait=False) as fd:
            if fd is None:
                return Recovered(JournalOutcome.IN_PROGRESS, pid=journal.holder(tree.state))
            return recover(tree)
    except UserError as exc:
        return Recovered(JournalOutcome.UNFINISHED, detail=str(exc))

"""Writing patch plans to a tree: one step for the user, whatever happens on the way.

`apply` and `revert` take the tree's lock, finish or undo what a killed run left (its journal),
record the new operation, and only then write: on git a branch, the files and a commit; elsewhere
the files plus the originals and a manifest in the state folder, so revert is exact.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_msprobe.engine import coverage, edited, git, gitstate, journal, manifest, space
from rl_msprobe.engine.inspection import holders
from rl_msprobe.engine.plan import plan_apply, plan_revert, unique_pieces
from rl_msprobe.engine.plan_parts import FileChange, Plan
from rl_msprobe.engine.recovery import recover
from rl_msprobe.engine.results import ApplyResult, GitCommit, Recovered, RevertResult
from rl_msprobe.engine.transaction import Transaction, write_entries
from rl_msprobe.engine.tree import Tree, open_tree
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet
from rl_msprobe.upstream.trees import Target

if TYPE_CHECKING:
    from git import Repo  # GitPython, imported at run time only where a tree is opened


def _preflight(root: Path, changes: list[FileChange]) -> None:
    """Refuse before writing anything when any file could not be written."""
    for change in changes:
        path = root / change.path
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            raise UserError(
                f"{path}: on a read-only file system (mounted read-only), so no mode change helps; remount it "
                "read-write, or patch a writable copy of the tree (--tree COPY). Nothing was changed."
            )
        if path.exists():
            mode = path.stat().st_mode
            if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
                raise UserError(
                    f"{path}: read-only; make it writable (chmod u+w) and run again. Nothing was changed."
                )
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            raise UserError(f"{parent}: folder is not writable; nothing was changed.")


@contextmanager
def _locked(target: Target) -> Iterator[tuple[Tree, Recovered | None]]:
    """Hold the tree's lock and first finish (or undo) whatever a killed run left half-done."""
    tree = open_tree(target, writing=True)
    if tree.repo is None:
        _state_writable(tree.state)
    with journal.tree_lock(tree.state):
        recovered = recover(tree)
        if tree.repo is not None:
            git.check_index_lock(tree.repo)
        yield tree, recovered


def _state_writable(state: Path) -> None:
    if state.exists() and not journal.writable_dir(state):
        raise UserError(
            f"{state}: rl-msprobe's state folder is read-only, so the originals could not be kept; make it "
            "writable (chmod u+w) and run again. Nothing was changed."
        )


def _recorded(tree: Tree) -> list[str]:
    """The sets applied to the tree and not reverted since, oldest first: on git the rl-msprobe commits
    of HEAD's history (so it follows branches), elsewhere the manifest."""
    if tree.repo is None:
        return manifest.recorded_in_manifest(tree.state)
    return git.recorded_sets(tree.repo)


def _writable(target: Target) -> None:
    if target.readonly:
        raise UserError(
            f"{target.origin}: a fetched release is read-only (diff and status only); pass --tree PATH or "
            "--python PY to patch the tree that runs."
        )


def _tree_entries(root: Path, changes: list[FileChange]) -> list[journal.Entry]:
    return [journal.Entry(root / c.path, c.before, c.after, c.path) for c in changes if c.before != c.after]


def _fields(
    plan: Plan, recovered: Recovered | None, changed: list[str], git_commit: GitCommit | None
) -> dict[str, Any]:
    """What an apply and a revert result share (the plan's reports, the tree's recovery)."""
    return {
        "tree": str(plan.target.root),
        "project": plan.target.project,
        "version": plan.target.version,
        "sets": tuple(s.name for s in plan.sets),
        "changed": tuple(changed),
        "skipped": tuple(plan.skipped),
        "kept": tuple(plan.kept),
        "git": git_commit,
        "noop": not changed,
        "tested": not plan.warnings,
        "warnings": tuple(plan.warnings),
        "recovered": recovered,
    }


# ---------------------------------------------------------------- apply


def apply(
    target: Target,
    sets: list[PatchSet],
    branch: str | None = None,
    make_branch: bool = True,
    allow_dirty: bool = False,
    entry_point: str | None = None,
) -> ApplyResult:
    """Apply `sets` to the tree: all files or none; on git a branch and a commit. With `entry_point`,
    refuse when a capability it needs has no site; without, report each piece not covered."""
    _writable(target)
    with _locked(target) as (tree, recovered):
        repo = tree.repo
        if branch and repo is not None:
            git.check_branch_name(repo, branch)
        if repo is not None:
            gitstate.check_sparse(repo, target.root, [piece.path for _, piece in unique_pieces(sets)])
        plan = plan_apply(target, sets, entry_point)
        edited.check_helpers(tree, plan, "apply")
        if repo is None:
            edited.check_links(target.root, plan.changes)
        notes = (*tree.notes, *(note for s in sets for note in s.notes_for(target.version)))
        changed = [c.path for c in plan.changes]
        recorded = _recorded(tree)
        commit, kept_in = None, None
        # files to change, or a set whose pieces another set put there: recorded, so reverting that
        # other set keeps them (on git an empty commit, elsewhere the manifest)
        if plan.changes or not all(s.name in recorded for s in sets):
            if repo is not None:
                commit = _apply_git(tree, target, sets, plan, branch, make_branch, allow_dirty)
            else:
                _preflight(target.root, plan.changes)
                space.require(tree, plan.changes)
                entries = _tree_entries(target.root, plan.changes) + manifest.apply_state(
                    tree.state, plan, recorded
                )
                Transaction(tree, "apply", tuple(entries)).run()
                kept_in = str(manifest.manifest_path(tree.state))
    fields = _fields(plan, recovered, changed, commit)
    merged: dict[str, bool] = {}
    for by_entry in plan.entry_points.values():
        for name, ok in by_entry.items():
            merged[name] = merged.get(name, True) and ok
    return ApplyResult(
        **fields,
        notes=notes,
        manifest=kept_in,
        entry_point=entry_point,
        not_covered=tuple(m for m in plan.not_covered if m.in_tree),
        entry_points=merged,
        not_in_tree=coverage.not_in_tree(plan.not_covered),
    )


def _apply_git(
    tree: Tree,
    target: Target,
    sets: list[PatchSet],
    plan: Plan,
    branch: str | None,
    make_branch: bool,
    allow_dirty: bool,
) -> GitCommit:
    repo = tree.repo
    assert repo is not None  # a git tree
    gitstate.check_idle(repo)
    space.require(tree, plan.changes)  # a full disk refused with its figure before git is asked anything
    # no file to change (only the record): the user's uncommitted work is never part of that commit
    gitstate.check_clean(repo, target.root, plan.changes, allow_dirty or not plan.changes)
    paths = git.repo_paths(repo, target.root, plan.changes)
    _preflight(target.root, plan.changes)
    original_branch, from_head = git.head_state(repo)
    assert from_head is not None  # open_tree refuses a repository without commits
    name = branch or git.default_branch(sets)
    new_branch = make_branch and original_branch != name
    if new_branch:
        git.check_branch_name(repo, name)
    message = git.message("apply", target, sets, plan)
    files = [(path, change.after) for path, change in zip(paths, plan.changes)]
    space.require(tree, plan.changes)
    tree_id, commit = _objects(tree, files, message, from_head)
    info = {
        "from_branch": original_branch,
        "from_head": from_head,
        "branch": name if new_branch else None,
        "paths": paths,
        "message": message,
        "tree": tree_id,
        "commit": commit,
        "v": 2,  # commit built as objects first, the ref moved last (git.committed)
    }
    entries = tuple(_tree_entries(target.root, plan.changes))

    def steps() -> str:
        write_entries(entries)
        git.publish(repo, info)
        return commit

    # git's index lock from before the first file is written until the commit is in (git.holding_index)
    sha = Transaction(tree, "apply", entries, info).run(steps, hold=lambda: git.holding_index(repo))
    return GitCommit(name if new_branch else original_branch, sha, original_branch)


def _objects(tree: Tree, files: list[tuple[str, bytes | None]], message: str, parent: str) -> tuple[str, str]:
    """The commit as git objects, before any file is written (a full disk fails here, nothing changed)."""
    assert tree.repo is not None  # a git tree
    try:
        return git.build_commit(tree.repo, files, message, parent)
    except git.git_error() as exc:
        raise UserError(
            f"{tree.repo.working_tree_dir}: git could not store the commit's objects "
            f"({git.one_line(getattr(exc, 'stderr', str(exc)))}); free some space or fix the repository and "
            "run again. Nothing was changed."
        ) from None


# ---------------------------------------------------------------- revert


def revert(target: Target, sets: list[PatchSet]) -> RevertResult:
    """Revert `sets`: files byte-identical to before the apply; on git a revert commit on the current branch."""
    _writable(target)
    with _locked(target) as (tree, recovered):
        repo = tree.repo
        if repo is not None:
            gitstate.check_sparse(repo, target.root, [piece.path for _, piece in unique_pieces(sets)])
        recorded = _recorded(tree)
        keep = holders(target, sets, recorded)
        plan = plan_revert(target, sets, None if repo is not None else tree.state, keep)
        deleted = _deleted_helpers(repo, target, sets, keep) if repo is not None else []
        changed = [c.path for c in plan.changes]
        commit = None
        unrecord = any(s.name in recorded for s in sets)
        if plan.changes or deleted or unrecord:
            if repo is not None:
                commit = _revert_git(tree, target, sets, plan, deleted, unrecord)
                changed = sorted([*changed, *deleted])
            else:
                edited.check_helpers(tree, plan, "revert")
                edited.check_links(target.root, plan.changes)
                entries = _tree_entries(target.root, plan.changes) + manifest.revert_state(
                    tree.state, plan, recorded
                )
                _preflight(target.root, plan.changes)
                space.require(tree, plan.changes)
                Transaction(tree, "revert", tuple(entries)).run()
                manifest.tidy_state(tree.state)
    return RevertResult(**_fields(plan, recovered, changed, commit), notes=tuple(tree.notes))


def _deleted_helpers(
    repo: Repo, target: Target, sets: list[PatchSet], keep: dict[str, list[str]]
) -> list[str]:
    """Files a set adds that the user deleted but the branch still has: the revert commit removes them too."""
    out = []
    for _, piece in unique_pieces(sets):
        if piece.label in keep:
            continue
        if isinstance(piece.item, NewFile) and not (target.root / piece.path).exists():
            rel = git.repo_paths(repo, target.root, [FileChange(piece.path, None, None)])[0]
            if git.run(repo, "cat-file", "-e", f"HEAD:{rel}").returncode == 0:
                out.append(piece.path)
    return out


def _revert_git(
    tree: Tree, target: Target, sets: list[PatchSet], plan: Plan, deleted: list[str], unrecord: bool
) -> GitCommit | None:
    repo = tree.repo
    assert repo is not None  # a git tree
    gitstate.check_idle(repo)
    space.require(tree, plan.changes)  # a full disk refused with its figure before git is asked anything
    paths = git.repo_paths(repo, target.root, plan.changes)
    gone = git.repo_paths(repo, target.root, [FileChange(p, None, None) for p in deleted])
    if paths:
        shown = {
            line[3:]
            for line in git.run(repo, "status", "--porcelain", "--", *paths).stdout.splitlines()
            if not line.startswith("??")
        }
        edited = sorted(shown | set(gitstate.hidden_edits(repo, paths)))
        if edited:
            raise UserError(
                f"{', '.join(edited)}: uncommitted changes in files the revert would commit; commit or stash "
                "them first (rl-msprobe never mixes your edits into its commit). Nothing was changed."
            )
    _preflight(target.root, plan.changes)
    known = set(git.call(repo, "ls-files", "-z", "--", *paths).split("\0")) if paths else set()
    tracked = [p for p in paths if p in known] + gone
    message = git.message("revert", target, sets, plan)
    if deleted:
        message += "".join(f"  {p} (deleted by hand before the revert)\n" for p in deleted)
    from_branch, from_head = git.head_state(repo)
    assert from_head is not None  # open_tree refuses a repository without commits
    after = dict(zip(paths, (c.after for c in plan.changes)))
    files = [(path, after.get(path)) for path in tracked]
    commit = None
    space.require(tree, plan.changes)
    if tracked or unrecord:  # no file tracked but the sets are recorded: an empty commit drops them
        _, commit = _objects(tree, files, message, from_head)
    info: dict[str, Any] = {  # the journal's git record (git.publish, leave_branch)
        "from_branch": from_branch,
        "from_head": from_head,
        "branch": None,
        "paths": tracked,
        "message": message,
        "commit": commit,
        "v": 2,
    }
    entries = tuple(_tree_entries(target.root, plan.changes))

    def steps() -> str | None:
        write_entries(entries)
        if commit is not None:
            git.publish(repo, info)
        return commit

    sha = Transaction(tree, "revert", entries, info).run(steps, hold=lambda: git.holding_index(repo))
    if sha is None:
        return None
    return GitCommit(info["from_branch"], sha)

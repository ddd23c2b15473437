"""Writing patch plans to a tree: one step for the user, whatever happens on the way.

`apply` and `revert` take the tree's lock, finish or undo what a killed run left (its journal),
record the new operation, and only then write: on git a branch, the files and a commit; elsewhere
the files plus the originals and a manifest in the state folder, so revert is exact.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import __version__, journal
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet
from rl_msprobe.targets import Target
from rl_msprobe.workspace import (
    MANIFEST,
    FileChange,
    Plan,
    _load_manifest,
    _manifest_path,
    _unique_pieces,
    holders,
    plan_apply,
    plan_revert,
    recorded_in_manifest,
)

# ---------------------------------------------------------------- writing


def _preflight(root: Path, changes: list[FileChange]) -> None:
    """Refuse before writing anything when any file could not be written."""
    for change in changes:
        path = root / change.path
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


def _write_entries(entries: list[journal.Entry]) -> None:
    for entry in entries:
        journal.write_file(entry.path, entry.after, durable=True, step=f"replace:{entry.label}")
        journal.checkpoint(f"write:{entry.label}")


# ---------------------------------------------------------------- the tree: git or not, lock, journal


def open_repo(root: Path) -> Any | None:
    """The git repository holding the tree, or None (GitPython is imported only here)."""
    import git

    try:
        return git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None


def _git(repo: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo.working_tree_dir), *args], capture_output=True, text=True, check=False
    )


def _ignored_by(repo: Any, target: Target) -> bool:
    """The package folder is ignored by the enclosing repo (a venv inside a project) and none of it is tracked."""
    top = Path(repo.working_tree_dir).resolve()
    try:
        rel = target.package_dir.resolve().relative_to(top).as_posix()
    except ValueError:
        return False
    if _git(repo, "check-ignore", "-q", "--", rel).returncode != 0:
        return False
    return not _git(repo, "ls-files", "--", rel).stdout.strip()


@dataclass
class Tree:
    """How a tree is written: its git repo (None: files + manifest), its state folder, and why."""

    repo: Any | None
    state: Path
    notes: list[str] = field(default_factory=list)


def _tree(target: Target, writing: bool) -> Tree:
    repo = open_repo(target.root)
    notes = []
    if repo is not None and repo.working_tree_dir is not None and _ignored_by(repo, target):
        notes.append(
            f"{target.package_dir} is ignored by the git repository at {repo.working_tree_dir} (.gitignore): "
            "patched without git, originals kept beside it for an exact revert."
        )
        repo = None
    if repo is not None and writing and not repo.head.is_valid():
        raise UserError(
            f"{repo.working_tree_dir}: a git repository with no commits yet; rl-msprobe commits on top of the "
            "upstream files. Commit them first (git add -A && git commit -m upstream) and run again."
        )
    state = journal.state_dir(target.root, Path(repo.git_dir) if repo is not None else None)
    return Tree(repo, state, notes)


@contextmanager
def _locked(target: Target) -> Iterator[tuple[Tree, dict[str, Any] | None]]:
    """Hold the tree's lock and first finish (or undo) whatever a killed run left half-done."""
    tree = _tree(target, writing=True)
    if tree.repo is None:
        _state_writable(tree.state)
    with journal.tree_lock(tree.state):
        recovered = _recover(tree)
        if tree.repo is not None:
            _check_index_lock(tree.repo)
        yield tree, recovered


def _state_writable(state: Path) -> None:
    if state.exists() and not journal.writable_dir(state):
        raise UserError(
            f"{state}: rl-msprobe's state folder is read-only, so the originals could not be kept; make it "
            "writable (chmod u+w) and run again. Nothing was changed."
        )


def _recover(tree: Tree) -> dict[str, Any] | None:
    """An unfinished journal: complete it when its commit was made, else put every file back."""
    doc = journal.load(tree.state)
    if doc is None:
        return None
    info = doc.get("git")
    cleared = _clear_index_lock(tree.repo, doc) if tree.repo is not None else None
    if info and tree.repo is not None and _committed(tree.repo, info):
        outcome = "completed"
    else:
        try:
            _roll_back(tree, doc)
        except (OSError, _git_error()) as exc:
            raise UserError(
                f"an interrupted rl-msprobe {doc['op']} (pid {doc['pid']}) could not be undone ({exc}); "
                f"fix that and run again (journal in {tree.state / journal.JOURNAL})."
            ) from exc
        outcome = "rolled back"
    journal.finish(tree.state)
    return {
        "op": doc["op"],
        "pid": doc["pid"],
        "outcome": outcome,
        "files": [f["label"] for f in doc["files"]],
        **({"removed": cleared} if cleared else {}),
    }


def _index_lock(repo: Any) -> Path:
    return Path(repo.git_dir) / "index.lock"


def _clear_index_lock(repo: Any, doc: dict[str, Any]) -> str | None:
    """A git command killed together with the interrupted run leaves git's `index.lock`, and every
    later git command refuses to run. One made after that run's journal was written is its own:
    removed (the journal's lock is held, so no other rl-msprobe runs here)."""
    lock = _index_lock(repo)
    try:
        made = lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if made < float(doc.get("started", 0)) - 1.0:
        return None  # older than the run: not its own (refused, named, by `_check_index_lock`)
    lock.unlink()
    return str(lock)


def _check_index_lock(repo: Any) -> None:
    lock = _index_lock(repo)
    if lock.exists():
        raise UserError(
            f"{lock}: git's index lock is there, so git refuses to change {repo.working_tree_dir}: another git "
            "command is running in it, or one was killed and left the file. Wait for it to end, or remove the "
            "file if no git process is running, and run again. Nothing was changed."
        )


def _git_error() -> type[Exception]:
    import git

    return git.GitCommandError


def _committed(repo: Any, info: dict[str, Any]) -> bool:
    ref = f"refs/heads/{info['branch']}" if info.get("branch") else "HEAD"
    try:
        commit = repo.commit(ref)
    except Exception:  # noqa: BLE001 - no such ref: nothing was committed
        return False
    return [p.hexsha for p in commit.parents] == [info["from_head"]] and str(commit.message).strip() == str(
        info["message"]
    ).strip()


def _roll_back(tree: Tree, doc: dict[str, Any]) -> None:
    """Files, index and branch back to how the journal found them."""
    journal.roll_back_files(tree.state, doc)
    info = doc.get("git")
    repo = tree.repo
    if not info or repo is None:
        return
    if info["paths"]:
        repo.git.reset("-q", "--", *info["paths"])
    name = info.get("branch")
    if not name:
        return
    if not repo.head.is_detached and repo.active_branch.name == name:
        leave_branch(repo, info)
    if name in [h.name for h in repo.heads] and repo.commit(name).hexsha == info["from_head"]:
        repo.git.branch("-D", name)


def leave_branch(repo: Any, info: dict[str, Any]) -> None:
    """Back from rl-msprobe's new branch to where the operation started (a branch, or a detached HEAD)."""
    if info["from_branch"]:
        repo.git.checkout("-q", info["from_branch"])
    else:
        repo.git.checkout("-q", "--detach", info["from_head"])


def _undo(tree: Tree, exc: BaseException) -> None:
    """The operation failed part-way: put everything back now, or leave the journal for the next run."""
    doc = journal.load(tree.state)
    try:
        if doc is not None:
            _roll_back(tree, doc)
            journal.finish(tree.state)
    except (OSError, UserError, _git_error()) as err:
        raise UserError(
            f"{_why(exc)}, and undoing it failed too ({_why(err)}). The tree is recorded in "
            f"{tree.state / journal.JOURNAL}: the next rl-msprobe command on it finishes undoing it."
        ) from exc
    if isinstance(exc, (OSError, _git_error())):
        raise UserError(f"{_why(exc)}; every file was restored, nothing was changed.") from exc


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.filename or 'a file'}: could not be written ({exc.strerror})"
    stderr = getattr(exc, "stderr", None)
    if stderr:
        return f"git failed: {str(stderr).strip()[-300:]}"
    return str(exc)


def recovery_for_status(target: Target) -> dict[str, Any] | None:
    """`status` finishes a killed run's journal when it can take the lock, and says so; else reports it."""
    if target.readonly:
        return None
    repo = open_repo(target.root)
    places = [target.root / journal.STATE_DIR, journal.cache_state_dir(target.root)]
    places += [Path(repo.git_dir) / "rl-msprobe"] if repo is not None else []
    if not any((p / journal.JOURNAL).exists() for p in places):
        return None  # the common case, without asking git anything more
    try:
        tree = _tree(target, writing=False)
    except UserError:
        return None
    if not (tree.state / journal.JOURNAL / "journal.json").exists():
        return None
    try:
        with journal.tree_lock(tree.state, wait=False) as fd:
            if fd is None:
                return {"outcome": "in progress", "pid": journal.holder(tree.state)}
            return _recover(tree)
    except UserError as exc:
        return {"outcome": "unfinished", "detail": str(exc)}


# ---------------------------------------------------------------- git / manifest


def _repo_paths(repo: Any, root: Path, changes: list[FileChange]) -> list[str]:
    top = Path(repo.working_tree_dir).resolve()
    out = []
    for change in changes:
        real = (root / change.path).resolve()
        try:
            out.append(real.relative_to(top).as_posix())
        except ValueError:
            raise UserError(
                f"{root / change.path}: a symlink to {real}, outside the git repository {top}; rl-msprobe cannot "
                "commit it there. Replace the link by the file, or patch the tree it points into. Nothing was "
                "changed."
            ) from None
    return out


def _commit(repo: Any, paths: list[str], message: str) -> str:
    """Commit `paths` (none: an empty commit that only records the sets, the user's index left alone)."""
    if paths:
        repo.git.add("-A", "--", *paths)
    journal.checkpoint("staged")
    env = {}
    reader = repo.config_reader()
    if not reader.has_option("user", "name"):
        env.update(GIT_AUTHOR_NAME="rl-msprobe", GIT_COMMITTER_NAME="rl-msprobe")
    if not reader.has_option("user", "email"):
        env.update(GIT_AUTHOR_EMAIL="rl-msprobe@localhost", GIT_COMMITTER_EMAIL="rl-msprobe@localhost")
    with repo.git.custom_environment(**env):
        repo.git.commit("-q", "-m", message, *(["--", *paths] if paths else ["--only", "--allow-empty"]))
    journal.checkpoint("committed")
    return repo.head.commit.hexsha


def default_branch(sets: list[PatchSet]) -> str:
    return "rl-msprobe/" + "+".join(s.name for s in sets)


def _check_branch_name(repo: Any, name: str) -> None:
    if _git(repo, "check-ref-format", "--branch", name).returncode != 0:
        raise UserError(
            f"--branch {name!r}: not a valid git branch name (see `git check-ref-format`); pass another name."
        )
    if name in [h.name for h in repo.heads]:
        raise UserError(
            f"branch {name} already exists in {repo.working_tree_dir}; check it out, delete it, "
            "or pass --branch NAME."
        )


def _message(verb: str, target: Target, sets: list[PatchSet], plan: Plan) -> str:
    lines = [
        f"rl-msprobe: {verb} {', '.join(s.name for s in sets)}",
        "",
        f"Sets: {', '.join(s.name for s in sets)}",
        f"Upstream: {target.project} {target.version or 'unknown'}",
        f"Tool: rl-msprobe {__version__}",
        "Files:",
        *(f"  {c.path} ({', '.join(c.pieces)})" for c in plan.changes),
        *(f"Kept: {r.path} ({r.piece}; {r.detail})" for r in plan.kept),
    ]
    return "\n".join(lines) + "\n"


def _check_git_clean(repo: Any, root: Path, changes: list[FileChange], allow_dirty: bool) -> None:
    dirty = [item.a_path for item in repo.index.diff(None)] + [
        item.a_path for item in repo.index.diff("HEAD")
    ]
    if not dirty:
        return
    if not allow_dirty:
        raise UserError(
            f"{repo.working_tree_dir}: uncommitted changes ({', '.join(sorted(set(dirty))[:5])}); commit or stash "
            "them, or pass --allow-dirty (your changes are then left as they are)."
        )
    touched = set(_repo_paths(repo, root, changes))
    clash = sorted(touched & set(dirty))
    if clash:
        raise UserError(
            f"{', '.join(clash)}: has uncommitted changes and would be patched; commit or stash it first "
            "(even with --allow-dirty rl-msprobe never mixes your edits into its commit)."
        )


_SUBJECT = re.compile(r"rl-msprobe: (apply|revert) (.+)")


def _recorded(tree: Tree) -> list[str]:
    """The sets applied to the tree and not reverted since, oldest first: on git the rl-msprobe commits
    of HEAD's history (so it follows branches), elsewhere the manifest."""
    if tree.repo is None:
        return recorded_in_manifest(tree.state)
    log = _git(
        tree.repo, "log", "--reverse", "-E", "--grep=^rl-msprobe: (apply|revert) ", "--format=%s", "HEAD"
    )
    applied: list[str] = []
    for line in log.stdout.splitlines():
        match = _SUBJECT.fullmatch(line.strip())
        if not match:
            continue
        names = match.group(2).split(", ")
        applied = [n for n in applied if n not in names]
        applied += names if match.group(1) == "apply" else []
    return applied


def _dump_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def _apply_state(state: Path, plan: Plan, recorded: list[str]) -> list[journal.Entry]:
    """Outside git: the manifest and saved originals after applying `plan` (written with the files)."""
    manifest = _load_manifest(state)
    manifest["applied"] = [*recorded, *(s.name for s in plan.sets if s.name not in recorded)]
    files = manifest.setdefault("files", {})
    entries = []
    for change in plan.changes:
        entry = files.get(change.path)
        if entry is None:
            entry = {"original_sha256": journal.sha(change.before), "existed": change.before is not None}
            if change.before is not None:
                saved = state / "originals" / change.path
                entries.append(
                    journal.Entry(saved, journal.read(saved), change.before, f"originals/{change.path}")
                )
            files[change.path] = entry
        entry["applied_sha256"] = journal.sha(change.after)
        entry["sets"] = sorted(set(entry.get("sets", [])) | {s.name for s in plan.sets})
    manifest["tool"] = __version__
    path = _manifest_path(state)
    entries.append(journal.Entry(path, journal.read(path), _dump_manifest(manifest), MANIFEST))
    return entries


def _revert_state(state: Path, plan: Plan, recorded: list[str]) -> list[journal.Entry]:
    """Outside git: the manifest without the reverted files and sets, their saved originals removed."""
    path = _manifest_path(state)
    if journal.read(path) is None:
        return []
    manifest = _load_manifest(state)
    reverted = {s.name for s in plan.sets}
    manifest["applied"] = [name for name in recorded if name not in reverted]
    files = manifest.get("files", {})
    entries = []
    for change in plan.changes:
        files.pop(change.path, None)
        saved = state / "originals" / change.path
        data = journal.read(saved)
        if data is not None:
            entries.append(journal.Entry(saved, data, None, f"originals/{change.path}"))
    after = _dump_manifest(manifest) if files else None
    entries.append(journal.Entry(path, journal.read(path), after, MANIFEST))
    return entries


def _tidy_state(state: Path) -> None:
    """Empty folders of saved originals go; with no manifest left, the lock release removes the rest."""
    originals = state / "originals"
    if not originals.is_dir():
        return
    for folder in sorted((p for p in originals.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    if not any(originals.iterdir()):
        originals.rmdir()


def _result(plan: Plan) -> dict[str, Any]:
    """The JSON document of `patch apply` / `patch revert` (git and noop filled in later)."""
    return {
        "tree": str(plan.target.root),
        "project": plan.target.project,
        "version": plan.target.version,
        "sets": [s.name for s in plan.sets],
        "changed": [c.path for c in plan.changes],
        "skipped": [r.to_json() for r in plan.skipped],
        "kept": [{**r.to_json(), "set": r.set} for r in plan.kept],
        "git": None,
        "noop": not plan.changes,
        "tested": not plan.warnings,
        "warnings": plan.warnings,
    }


def _writable(target: Target) -> None:
    if target.readonly:
        raise UserError(
            f"{target.origin}: a fetched release is read-only (diff and status only); pass --tree PATH or "
            "--python PY to patch the tree that runs."
        )


def _tree_entries(root: Path, changes: list[FileChange]) -> list[journal.Entry]:
    return [journal.Entry(root / c.path, c.before, c.after, c.path) for c in changes if c.before != c.after]


@dataclass(frozen=True)
class Done:
    """A finished apply or revert on one tree: what a command over several trees takes back when a
    later tree fails (`rl_msprobe.multitree`)."""

    tree: Tree
    entries: list[journal.Entry]
    git: dict[str, Any] | None  # the journal's git record, with "commit": the commit made (None: none)


# set by `multitree.each` while a command runs over several trees: each finished operation lands here
DONE: ContextVar[list[Done] | None] = ContextVar("rl_msprobe_done", default=None)


def _run(tree: Tree, op: str, entries: list[journal.Entry], extra: dict[str, Any], steps: Any) -> Any:
    """Journal first, then the steps; any failure puts everything back (or leaves it to the next run)."""
    journal.begin(tree.state, op, entries, extra)
    try:
        journal.checkpoint("journal")
        out = steps()
    except BaseException as exc:
        _undo(tree, exc)
        raise
    journal.finish(tree.state)
    done = DONE.get()
    if done is not None:
        info = extra.get("git")
        done.append(Done(tree, entries, {**info, "commit": out} if info else None))
    return out


def apply(
    target: Target,
    sets: list[PatchSet],
    branch: str | None = None,
    make_branch: bool = True,
    allow_dirty: bool = False,
) -> dict[str, Any]:
    """Apply `sets` to the tree: all files or none; on git a branch and a commit."""
    _writable(target)
    with _locked(target) as (tree, recovered):
        repo = tree.repo
        if branch and repo is not None:
            _check_branch_name(repo, branch)
        plan = plan_apply(target, sets)
        result = _result(plan)
        result["recovered"] = recovered
        result["tree_notes"] = tree.notes
        recorded = _recorded(tree)
        if not plan.changes and all(s.name in recorded for s in sets):
            return result
        # files to change, or a set whose pieces another set put there: recorded, so reverting that
        # other set keeps them (on git an empty commit, elsewhere the manifest)
        if repo is not None:
            result["git"] = _apply_git(tree, target, sets, plan, branch, make_branch, allow_dirty)
        else:
            _preflight(target.root, plan.changes)
            entries = _tree_entries(target.root, plan.changes) + _apply_state(tree.state, plan, recorded)
            _run(tree, "apply", entries, {"git": None}, lambda: _write_entries(entries))
            result["manifest"] = str(_manifest_path(tree.state))
    return result


def _apply_git(
    tree: Tree,
    target: Target,
    sets: list[PatchSet],
    plan: Plan,
    branch: str | None,
    make_branch: bool,
    allow_dirty: bool,
) -> dict[str, Any]:
    repo = tree.repo
    # no file to change (only the record): the user's uncommitted work is never part of that commit
    _check_git_clean(repo, target.root, plan.changes, allow_dirty or not plan.changes)
    paths = _repo_paths(repo, target.root, plan.changes)
    _preflight(target.root, plan.changes)
    original_branch = None if repo.head.is_detached else repo.active_branch.name
    name = branch or default_branch(sets)
    new_branch = make_branch and original_branch != name
    if new_branch:
        _check_branch_name(repo, name)
    message = _message("apply", target, sets, plan)
    info = {
        "from_branch": original_branch,
        "from_head": repo.head.commit.hexsha,
        "branch": name if new_branch else None,
        "paths": paths,
        "message": message,
    }
    entries = _tree_entries(target.root, plan.changes)

    def steps() -> str:
        if new_branch:
            repo.git.checkout("-q", "-b", name)
            journal.checkpoint("branch")
        _write_entries(entries)
        return _commit(repo, paths, message)

    sha = _run(tree, "apply", entries, {"git": info}, steps)
    return {"branch": repo.active_branch.name, "commit": sha, "from_branch": original_branch}


def revert(target: Target, sets: list[PatchSet]) -> dict[str, Any]:
    """Revert `sets`: files byte-identical to before the apply; on git a revert commit on the current branch."""
    _writable(target)
    with _locked(target) as (tree, recovered):
        repo = tree.repo
        recorded = _recorded(tree)
        keep = holders(target, sets, recorded)
        plan = plan_revert(target, sets, None if repo is not None else tree.state, keep)
        deleted = _deleted_helpers(repo, target, sets, keep) if repo is not None else []
        result = _result(plan)
        result["recovered"] = recovered
        result["tree_notes"] = tree.notes
        unrecord = any(s.name in recorded for s in sets)
        if not plan.changes and not deleted and not unrecord:
            return result
        if repo is not None:
            result["git"] = _revert_git(tree, target, sets, plan, deleted, unrecord)
            result["changed"] = sorted([*result["changed"], *deleted])
            result["noop"] = not result["changed"]
        else:
            entries = _tree_entries(target.root, plan.changes) + _revert_state(tree.state, plan, recorded)
            _preflight(target.root, plan.changes)
            _run(tree, "revert", entries, {"git": None}, lambda: _write_entries(entries))
            _tidy_state(tree.state)
    return result


def _deleted_helpers(
    repo: Any, target: Target, sets: list[PatchSet], keep: dict[str, list[str]]
) -> list[str]:
    """Files a set adds that the user deleted but the branch still has: the revert commit removes them too."""
    out = []
    for _, piece in _unique_pieces(sets):
        if piece.label in keep:
            continue
        if isinstance(piece.item, NewFile) and not (target.root / piece.path).exists():
            rel = _repo_paths(repo, target.root, [FileChange(piece.path, None, None)])[0]
            if _git(repo, "cat-file", "-e", f"HEAD:{rel}").returncode == 0:
                out.append(piece.path)
    return out


def _revert_git(
    tree: Tree, target: Target, sets: list[PatchSet], plan: Plan, deleted: list[str], unrecord: bool
) -> dict[str, Any] | None:
    repo = tree.repo
    paths = _repo_paths(repo, target.root, plan.changes)
    gone = _repo_paths(repo, target.root, [FileChange(p, None, None) for p in deleted])
    if paths:
        edited = sorted(
            line[3:]
            for line in _git(repo, "status", "--porcelain", "--", *paths).stdout.splitlines()
            if not line.startswith("??")
        )
        if edited:
            raise UserError(
                f"{', '.join(edited)}: uncommitted changes in files the revert would commit; commit or stash "
                "them first (rl-msprobe never mixes your edits into its commit). Nothing was changed."
            )
    _preflight(target.root, plan.changes)
    known = set(repo.git.ls_files("--", *paths).splitlines()) if paths else set()
    tracked = [p for p in paths if p in known] + gone
    message = _message("revert", target, sets, plan)
    if deleted:
        message += "".join(f"  {p} (deleted by hand before the revert)\n" for p in deleted)
    info = {
        "from_branch": None if repo.head.is_detached else repo.active_branch.name,
        "from_head": repo.head.commit.hexsha,
        "branch": None,
        "paths": tracked,
        "message": message,
    }
    entries = _tree_entries(target.root, plan.changes)

    def steps() -> str | None:
        _write_entries(entries)
        # no file tracked but the sets are recorded: an empty commit drops them from the record
        return _commit(repo, tracked, message) if tracked or unrecord else None

    sha = _run(tree, "revert", entries, {"git": info}, steps)
    if sha is None:
        return None
    return {"branch": info["from_branch"], "commit": sha}

"""The git side of writing a tree: the repository, clean checks, branch, commit, and the record of
applied sets kept in rl-msprobe's commit subjects (GitPython is imported only when a tree is opened)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from rl_msprobe import __version__
from rl_msprobe.engine import journal
from rl_msprobe.engine.model import FileChange, Plan
from rl_msprobe.errors import UserError
from rl_msprobe.patches import PatchSet
from rl_msprobe.upstream.trees import Target


def open_repo(root: Path) -> Any | None:
    """The git repository holding the tree, or None (GitPython is imported only here)."""
    import git

    try:
        return git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None


def git_error() -> type[Exception]:
    """GitPython's error for a failed git command (imported late, as GitPython is)."""
    import git

    return git.GitCommandError


def run(repo: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo.working_tree_dir), *args], capture_output=True, text=True, check=False
    )


def ignored_by(repo: Any, target: Target) -> bool:
    """The package folder is ignored by the enclosing repo (a venv inside a project) and none of it is tracked."""
    top = Path(repo.working_tree_dir).resolve()
    try:
        rel = target.package_dir.resolve().relative_to(top).as_posix()
    except ValueError:
        return False
    if run(repo, "check-ignore", "-q", "--", rel).returncode != 0:
        return False
    return not run(repo, "ls-files", "--", rel).stdout.strip()


# ---------------------------------------------------------------- git's index.lock


def index_lock(repo: Any) -> Path:
    return Path(repo.git_dir) / "index.lock"


def clear_index_lock(repo: Any, started: float) -> str | None:
    """A git command killed together with the interrupted run leaves git's `index.lock`, and every
    later git command refuses to run. One made after that run's journal was written (`started`) is
    its own: removed (the journal's lock is held, so no other rl-msprobe runs here)."""
    lock = index_lock(repo)
    try:
        made = lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if made < started - 1.0:
        return None  # older than the run: not its own (refused, named, by `check_index_lock`)
    lock.unlink()
    return str(lock)


def check_index_lock(repo: Any) -> None:
    lock = index_lock(repo)
    if lock.exists():
        raise UserError(
            f"{lock}: git's index lock is there, so git refuses to change {repo.working_tree_dir}: another git "
            "command is running in it, or one was killed and left the file. Wait for it to end, or remove the "
            "file if no git process is running, and run again. Nothing was changed."
        )


# ---------------------------------------------------------------- branches and commits


def committed(repo: Any, info: dict[str, Any]) -> bool:
    """Was the journal's commit (`info`: its git record) made?"""
    ref = f"refs/heads/{info['branch']}" if info.get("branch") else "HEAD"
    try:
        commit = repo.commit(ref)
    except Exception:  # noqa: BLE001 - no such ref: nothing was committed
        return False
    return [p.hexsha for p in commit.parents] == [info["from_head"]] and str(commit.message).strip() == str(
        info["message"]
    ).strip()


def leave_branch(repo: Any, info: dict[str, Any]) -> None:
    """Back from rl-msprobe's new branch to where the operation started (a branch, or a detached HEAD)."""
    if info["from_branch"]:
        repo.git.checkout("-q", info["from_branch"])
    else:
        repo.git.checkout("-q", "--detach", info["from_head"])


def repo_paths(repo: Any, root: Path, changes: list[FileChange]) -> list[str]:
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


def commit(repo: Any, paths: list[str], message: str) -> str:
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


def check_branch_name(repo: Any, name: str) -> None:
    if run(repo, "check-ref-format", "--branch", name).returncode != 0:
        raise UserError(
            f"--branch {name!r}: not a valid git branch name (see `git check-ref-format`); pass another name."
        )
    if name in [h.name for h in repo.heads]:
        raise UserError(
            f"branch {name} already exists in {repo.working_tree_dir}; check it out, delete it, "
            "or pass --branch NAME."
        )


def message(verb: str, target: Target, sets: list[PatchSet], plan: Plan) -> str:
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


def check_clean(repo: Any, root: Path, changes: list[FileChange], allow_dirty: bool) -> None:
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
    touched = set(repo_paths(repo, root, changes))
    clash = sorted(touched & set(dirty))
    if clash:
        raise UserError(
            f"{', '.join(clash)}: has uncommitted changes and would be patched; commit or stash it first "
            "(even with --allow-dirty rl-msprobe never mixes your edits into its commit)."
        )


_SUBJECT = re.compile(r"rl-msprobe: (apply|revert) (.+)")


def recorded_sets(repo: Any) -> list[str]:
    """The sets applied and not reverted since, oldest first: the rl-msprobe commits of HEAD's history
    (so the record follows branches)."""
    log = run(repo, "log", "--reverse", "-E", "--grep=^rl-msprobe: (apply|revert) ", "--format=%s", "HEAD")
    applied: list[str] = []
    for line in log.stdout.splitlines():
        match = _SUBJECT.fullmatch(line.strip())
        if not match:
            continue
        names = match.group(2).split(", ")
        applied = [n for n in applied if n not in names]
        applied += names if match.group(1) == "apply" else []
    return applied

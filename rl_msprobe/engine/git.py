"""The git side of writing a tree: the repository, clean checks, branch, commit, and the record of
applied sets kept in rl-msprobe's commit subjects (GitPython is imported only when a tree is opened)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_msprobe import __version__
from rl_msprobe.engine import gitenv, journal
from rl_msprobe.engine.plan_parts import FileChange, Plan
from rl_msprobe.errors import UserError
from rl_msprobe.patches import PatchSet
from rl_msprobe.upstream.trees import Target

if TYPE_CHECKING:
    from git import Repo  # GitPython, imported at run time only where a tree is opened


def open_repo(root: Path) -> Repo | None:
    """The git repository holding the tree, or None (GitPython is imported only here)."""
    import git

    try:
        with gitenv.without_location():  # the tree's repository, whatever GIT_DIR & co. name (gitenv)
            repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    _check_ownership(repo)
    return repo


def _check_ownership(repo: Repo) -> None:
    """git refuses a repository another user owns ("dubious ownership"): say so, never "no commits"."""
    if repo.working_tree_dir is None:
        return
    proc = run(repo, "rev-parse", "--git-dir")
    if proc.returncode != 0 and "dubious ownership" in proc.stderr:
        raise UserError(
            f'{repo.working_tree_dir}: git refuses this repository, it belongs to another user ("dubious '
            'ownership"). Patch it as its owner, or if you trust it: '
            f"git config --global --add safe.directory {repo.working_tree_dir} — then run again. Nothing was changed."
        )


def git_error() -> type[Exception]:
    """GitPython's error for a failed git command (imported late, as GitPython is)."""
    import git

    return git.GitCommandError


def run(repo: Repo, *args: str) -> subprocess.CompletedProcess[str]:
    """git ARGS in the tree's repository (never one the environment names: gitenv), not checked."""
    return subprocess.run(
        ["git", "-C", str(repo.working_tree_dir), *args],
        capture_output=True,
        text=True,
        check=False,
        env=gitenv.env(),
    )


def one_line(stderr: str, lines: int = 3) -> str:
    """git's error on one line: its last lines (the one saying what happened is rarely the first)."""
    text = [x.strip() for x in str(stderr).splitlines() if x.strip() and x.strip() not in ("'", "stderr: '")]
    text = [x.removeprefix("stderr: '").rstrip("'").strip() for x in text]
    return " / ".join(text[-lines:]) or "no message"


def work_tree(repo: Repo) -> Path:
    """The repository's work tree (open_repo found the repository from a tree inside it)."""
    top = repo.working_tree_dir
    assert top is not None, "open_repo opens the repository a tree lies in: never a bare one"
    return Path(top)


def ignored_by(repo: Repo, target: Target) -> bool:
    """The package folder is ignored by the enclosing repo (a venv inside a project) and none of it is tracked."""
    top = work_tree(repo).resolve()
    try:
        rel = target.package_dir.resolve().relative_to(top).as_posix()
    except ValueError:
        return False
    if run(repo, "check-ignore", "-q", "--", rel).returncode != 0:
        return False
    return not run(repo, "ls-files", "--", rel).stdout.strip()


# ---------------------------------------------------------------- git's index.lock


def index_lock(repo: Repo) -> Path:
    return Path(repo.git_dir) / "index.lock"


def live_git_processes(repo: Repo) -> list[str]:
    """Running git processes that may work in this repository ("PID" each; "PID?" where this user may
    not look at its folder, so it cannot be ruled out): from /proc, their command and working folder."""
    places = [os.path.realpath(p) for p in (repo.working_tree_dir, repo.git_dir) if p]
    found = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return ["?"]  # no /proc to look in: in doubt
    for pid in pids:
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv0 = handle.read(4096).split(b"\0", 1)[0]
        except OSError:
            continue  # ended meanwhile
        if not os.path.basename(argv0).startswith(b"git") or _parent(pid) == os.getpid():
            continue  # not git, or this process's own (GitPython's `cat-file --batch` helpers)
        try:
            cwd = os.path.realpath(os.readlink(f"/proc/{pid}/cwd"))
        except FileNotFoundError:
            continue
        except OSError:
            found.append(f"{pid}?")
            continue
        if any(cwd == p or cwd.startswith(p + os.sep) for p in places):
            found.append(pid)
    return found


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read(1024).rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def clear_index_lock(repo: Repo, started: float) -> str | None:
    """A git command killed together with the interrupted run leaves git's `index.lock`, and every
    later git command refuses to run. One made after that run's journal was written (`started`) may be
    its own, but newer is no proof: it is removed only when no git process runs in this repository;
    with one running (a user's `git add` of a big file), refused, naming it."""
    lock = index_lock(repo)
    try:
        made = lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if made < started - 1.0:
        return None  # older than the run: not its own (refused, named, by `check_index_lock`)
    live = live_git_processes(repo)
    if live:
        raise UserError(
            f"{lock}: git's index lock is there and git is running in {repo.working_tree_dir} (pid "
            f"{', '.join(live)}; '?': could not be ruled out), so it may be that command's; rl-msprobe leaves "
            "it alone. Wait for that git command to end and run again. Nothing was changed."
        )
    lock.unlink()
    return str(lock)


def check_index_lock(repo: Repo) -> None:
    lock = index_lock(repo)
    if lock.exists():
        raise UserError(
            f"{lock}: git's index lock is there, so git refuses to change {repo.working_tree_dir}: another git "
            "command is running in it, or one was killed and left the file. Wait for it to end, or remove the "
            "file if no git process is running, and run again. Nothing was changed."
        )


# ---------------------------------------------------------------- branches and commits


ZERO = "0" * 40


def call(repo: Repo, *args: str, data: bytes | None = None, env: dict[str, str] | None = None) -> str:
    """git ARGS in the tree's repository (gitenv: never one the environment names); its stdout
    (stripped); GitCommandError (git's stderr) when it fails."""
    proc = subprocess.run(
        ["git", "-C", str(repo.working_tree_dir), *args],
        input=data,
        capture_output=True,
        check=False,
        env=gitenv.env(env),
    )
    if proc.returncode != 0:
        import git

        raise git.GitCommandError(["git", *args], proc.returncode, proc.stderr.decode(errors="replace"))
    return proc.stdout.decode(errors="replace").strip()


def _identity(repo: Repo) -> dict[str, str]:
    env: dict[str, str] = {}
    have = {
        line.split(" ", 1)[0]
        for line in run(repo, "config", "--get-regexp", r"^user\.(name|email)$").stdout.splitlines()
    }
    if "user.name" not in have:
        env.update(GIT_AUTHOR_NAME="rl-msprobe", GIT_COMMITTER_NAME="rl-msprobe")
    if "user.email" not in have:
        env.update(GIT_AUTHOR_EMAIL="rl-msprobe@localhost", GIT_COMMITTER_EMAIL="rl-msprobe@localhost")
    return env


def build_commit(
    repo: Repo, files: list[tuple[str, bytes | None]], message: str, parent: str
) -> tuple[str, str]:
    """The commit of `files` (repo path -> bytes, None: removed) on top of `parent`, made as git objects
    only: a temporary index (GIT_INDEX_FILE) read from the parent's tree, `write-tree`, `commit-tree`.
    The user's index, HEAD and branches are not touched, so a `git commit` of the user's meanwhile
    can never take rl-msprobe's files. Returns (tree, commit)."""
    with tempfile.TemporaryDirectory(prefix="rl-msprobe-index-", dir=repo.git_dir) as folder:
        env = {"GIT_INDEX_FILE": os.path.join(folder, "index")}
        call(repo, "read-tree", parent, env=env)
        modes = {}
        listed = call(repo, "ls-tree", "-z", parent, "--", *[p for p, _ in files]) if files else ""
        for record in filter(None, listed.split("\0")):
            mode, _, rest = record.partition(" ")
            modes[rest.split("\t", 1)[1]] = mode
        lines = []
        for path, data in files:
            if data is None:
                lines.append(f"0 {ZERO}\t{path}")
            else:  # --path: the repository's attributes (filters, eol) apply as `git add` would apply them
                blob_id = call(repo, "hash-object", "-w", f"--path={path}", "--stdin", data=data)
                lines.append(f"{modes.get(path, '100644')} {blob_id}\t{path}")
        if lines:
            call(repo, "update-index", "-z", "--index-info", data="\0".join(lines).encode() + b"\0", env=env)
        tree = call(repo, "write-tree", env=env)
    commit = call(
        repo, "commit-tree", tree, "-p", parent, "-F", "-", data=message.encode(), env=_identity(repo)
    )
    return tree, commit


def _ref(info: dict[str, Any]) -> str:
    """The ref the journal's commit goes to: its new branch, the branch it started on, or a detached HEAD."""
    if info.get("branch"):
        return f"refs/heads/{info['branch']}"
    return f"refs/heads/{info['from_branch']}" if info.get("from_branch") else "HEAD"


def branch_exists(repo: Repo, name: str) -> bool:
    return run(repo, "show-ref", "--verify", "--quiet", f"refs/heads/{name}").returncode == 0


def rev(repo: Repo, name: str) -> str | None:
    """The commit `name` points at (None: no such commit)."""
    return run(repo, "rev-parse", "-q", "--verify", f"{name}^{{commit}}").stdout.strip() or None


def head_state(repo: Repo) -> tuple[str | None, str | None]:
    """(the branch HEAD is on, or None when detached; the commit it points at, None: no commit yet)."""
    both = run(repo, "rev-parse", "HEAD", "--symbolic-full-name", "HEAD", "--")  # one git process
    found = both.stdout.split()  # the commit, the ref (or "HEAD": detached), then "--" echoed back
    if both.returncode == 0 and len(found) == 3:
        commit, ref = found[:2]
        return (ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None), commit
    symbolic = run(repo, "symbolic-ref", "-q", "HEAD").stdout.strip()  # no commit yet
    return (symbolic.removeprefix("refs/heads/") or None), None


def _create_lock(lock: Path, repo: Repo, deadline: float) -> int:
    """Create git's lock file as git does (O_EXCL), retrying until DEADLINE while another git holds it."""
    while True:
        try:
            return os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            if time.monotonic() > deadline:
                raise UserError(
                    f"{lock}: another git command holds the index of {repo.working_tree_dir}; rl-msprobe waited "
                    "for it. Run again when it has ended. Nothing was changed."
                ) from None
            time.sleep(0.05)


@dataclass
class IndexLock:
    """git's `index.lock` of one repository, held by this process: its descriptor, and whether it was
    renamed into place as the new index (then it is never removed)."""

    fd: int
    path: Path
    published: bool = False


# the repositories whose index.lock this process holds (by git dir), so `publish` within reuses it
_HELD: ContextVar[dict[str, IndexLock] | None] = ContextVar("rl_msprobe_index_lock", default=None)


@contextmanager
def holding_index(repo: Repo, wait: float = 5.0) -> Iterator[IndexLock]:
    """git's own `index.lock`, taken as git takes it (O_EXCL): while rl-msprobe holds it no `git commit`,
    `add` or `checkout` of the user's can run (they fail at once: "index.lock: File exists"), so the
    files, the ref, HEAD and the index change together. Taken before the first file is written and
    held until `publish` renames it into place as the new index (on a failure: until the files are
    back). Waits briefly for a git command that holds it, then refuses (the caller undoes, nothing
    changed). Re-entrant: `publish` within it uses the same lock."""
    key = os.path.realpath(repo.git_dir)
    held = _HELD.get() or {}
    if key in held and not held[key].published:  # once renamed into place it is the index: a new lock
        yield held[key]
        return
    path = index_lock(repo)
    lock = IndexLock(_create_lock(path, repo, time.monotonic() + wait), path)
    token = _HELD.set({**held, key: lock})
    try:
        journal.checkpoint("index-lock")
        yield lock
    finally:
        _HELD.reset(token)
        os.close(lock.fd)
        if not lock.published:  # not renamed into place: nothing of it is used
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _index_for(repo: Repo, info: dict[str, Any]) -> bytes:
    """The user's index with the committed paths' entries taken from the commit (nothing else of it changes)."""
    with tempfile.TemporaryDirectory(prefix="rl-msprobe-index-", dir=repo.git_dir) as folder:
        temp = os.path.join(folder, "index")
        current = Path(repo.git_dir) / "index"
        if current.exists():
            shutil.copyfile(current, temp)
        env = {"GIT_INDEX_FILE": temp}
        paths = info["paths"]
        if not current.exists():
            call(repo, "read-tree", info["commit"], env=env)
        elif paths:
            listed = call(repo, "ls-tree", "-z", info["commit"], "--", *paths)
            entries = {}
            for record in filter(None, listed.split("\0")):
                meta, path = record.split("\t", 1)
                mode, _, blob_id = meta.split(" ")
                entries[path] = f"{mode} {blob_id}\t{path}"
            lines = [entries.get(p, f"0 {ZERO}\t{p}") for p in paths]
            call(repo, "update-index", "-z", "--index-info", data="\0".join(lines).encode() + b"\0", env=env)
        # the new entries' stat data from the files on disk (else git sees them "not uptodate")
        subprocess.run(
            ["git", "-C", str(repo.working_tree_dir), "update-index", "-q", "--refresh"],
            capture_output=True,
            check=False,
            env=gitenv.env(env),
        )
        return Path(temp).read_bytes()


def publish(repo: Repo, info: dict[str, Any]) -> None:
    """Make the journal's commit part of the repository, holding git's index lock throughout: the ref
    (an atomic update that fails if it moved meanwhile; a new branch must not exist yet), HEAD onto a
    new branch, and the user's index entries of the committed paths. Also finishes one a kill cut short."""
    with holding_index(repo) as lock:
        branch, at = head_state(repo)
        done = committed(repo, info)
        started_here = branch == info["from_branch"] and at == info["from_head"]
        if not done and not started_here:
            raise UserError(
                f"{repo.working_tree_dir}: HEAD moved while rl-msprobe worked (a commit or checkout of yours); "
                "it leaves your history as it is."
            )
        switch = bool(info.get("branch")) and started_here
        if done and not switch and at != info["commit"]:
            return  # finished before, and the user has moved on since: nothing of theirs is touched
        os.ftruncate(lock.fd, 0)  # a second publish under the same lock (an undo that finds the commit in)
        os.lseek(lock.fd, 0, os.SEEK_SET)
        _write_all(lock.fd, _index_for(repo, info))
        os.fsync(lock.fd)
        if not done:
            old = ZERO if info.get("branch") else info["from_head"]
            call(repo, "update-ref", "--no-deref", "-m", "rl-msprobe", _ref(info), info["commit"], old)
            journal.checkpoint("ref")
        if switch:
            call(repo, "symbolic-ref", "-m", "rl-msprobe", "HEAD", _ref(info))
            journal.checkpoint("head")
        os.replace(lock.path, Path(repo.git_dir) / "index")
        lock.published = True
    journal.checkpoint("published")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def committed(repo: Repo, info: dict[str, Any]) -> bool:
    """Was the journal's commit made? Decided from the commit object the journal names (its tree is
    exactly the planned one): the ref holds it, or a later commit on top of it. Never from the message,
    which a hook may have edited."""
    if info.get("v") != 2:  # a journal of an older rl-msprobe (`git commit`): its message and parent
        return _committed_by_message(repo, info)
    commit = info.get("commit")
    if not commit:
        return False
    tip = run(repo, "rev-parse", "-q", "--verify", f"{_ref(info)}^{{commit}}").stdout.strip()
    if not tip:
        return False
    if tip == commit:
        return True
    return run(repo, "merge-base", "--is-ancestor", commit, tip).returncode == 0


def _committed_by_message(repo: Repo, info: dict[str, Any]) -> bool:
    ref = f"refs/heads/{info['branch']}" if info.get("branch") else "HEAD"
    found = run(repo, "log", "-1", "--format=%P%x00%B", ref, "--")
    if found.returncode != 0:
        return False  # no such ref: nothing was committed
    parents, _, text = found.stdout.partition("\0")
    return parents.split() == [info["from_head"]] and text.strip() == str(info["message"]).strip()


def leave_branch(repo: Repo, info: dict[str, Any]) -> None:
    """Back from rl-msprobe's new branch to where the operation started (a branch, or a detached HEAD)."""
    if info["from_branch"]:
        call(repo, "checkout", "-q", info["from_branch"])
    else:
        call(repo, "checkout", "-q", "--detach", info["from_head"])


def repo_paths(repo: Repo, root: Path, changes: list[FileChange]) -> list[str]:
    top = work_tree(repo).resolve()
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


def default_branch(sets: list[PatchSet]) -> str:
    return "rl-msprobe/" + "+".join(s.name for s in sets)


def check_branch_name(repo: Repo, name: str) -> None:
    # a NUL byte cannot reach git at all (no argv holds one): refused here, as git would
    if "\x00" in name or run(repo, "check-ref-format", "--branch", name).returncode != 0:
        raise UserError(
            f"--branch {name!r}: not a valid git branch name (see `git check-ref-format`); pass another name."
        )
    if branch_exists(repo, name):
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
        *(f"Not covered: {m.entry_point}: {m.piece}: {m.reason}" for m in plan.not_covered if m.in_tree),
    ]
    return "\n".join(lines) + "\n"


_SUBJECT = re.compile(r"rl-msprobe: (apply|revert) (.+)")


def recorded_sets(repo: Repo) -> list[str]:
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

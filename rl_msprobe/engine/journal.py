"""Crash safety for `patch apply` / `patch revert`: one lock per tree and a write-ahead journal.

Before touching a file, apply and revert record what they are about to do and the bytes of every
file before and after (fsync'd). A run killed part-way leaves that journal behind; the next command
on the tree takes the lock, finds it and puts the tree back as it was (files, index, branch), unless
the git commit was already made, in which case the work is complete and only the journal goes.
A second command while one runs waits briefly, then refuses (exit 2) instead of interleaving.

Where: `<git dir>/rl-msprobe/` for a git tree (never shows in `git status`), `<tree>/.rl-msprobe/`
otherwise, or the user cache keyed by the tree's path when the tree cannot hold that folder.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_msprobe.errors import UserError
from rl_msprobe.upstream.releases import cache_dir

STATE_DIR = ".rl-msprobe"
LOCK = "lock"
JOURNAL = "journal"
LOCK_WAIT_S = 5.0


# ---------------------------------------------------------------- test hook


def checkpoint(step: str) -> None:
    """A named step of apply/revert; tests make the tool stop here (never set in normal use).

    RL_MSPROBE_STEPS_LOG=FILE appends each step's name; RL_MSPROBE_FAULT_AT=STEP with
    RL_MSPROBE_FAULT=kill (default: SIGKILL itself), pause (wait to be killed) or enospc
    (raise "no space left on device" there, and at every later step too).
    """
    log = os.environ.get("RL_MSPROBE_STEPS_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(step + "\n")
    at = os.environ.get("RL_MSPROBE_FAULT_AT")
    if not at:
        return
    global _faulting
    if at != step and not (_faulting and os.environ.get("RL_MSPROBE_FAULT") == "enospc"):
        return
    action = os.environ.get("RL_MSPROBE_FAULT", "kill")
    if action == "enospc":
        _faulting = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), step)
    if action == "pause":
        print(f"rl-msprobe paused at {step}", flush=True)
        while True:
            time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)


_faulting = False


# ---------------------------------------------------------------- files


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | None, durable: bool = False, step: str = "") -> None:
    """Replace `path` by `data` atomically (None: remove it); a symlink stays a link, its target is written.

    `step`: the checkpoint name between the temporary file and the replace (tests kill there).
    """
    if path.is_symlink():
        path = path.resolve()
    if data is None:
        if path.exists():
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        if step:
            checkpoint(step)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError as exc:
        raise UserError(
            f"{path}: cannot be read ({exc.strerror}); fix its permissions and run again."
        ) from exc


def writable_dir(path: Path) -> bool:
    """Whether files may be created in `path` (mode bits too: root ignores them, the user did not)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(path, os.W_OK)


# ---------------------------------------------------------------- where the state lives


def cache_state_dir(root: Path) -> Path:
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return cache_dir() / "trees" / key


def state_dir(root: Path, git_dir: Path | None) -> Path:
    """The folder of the lock, the journal and (outside git) the manifest and originals."""
    if git_dir is not None:
        return git_dir / "rl-msprobe"
    local = root / STATE_DIR
    if local.exists() or writable_dir(root):
        return local
    cached = cache_state_dir(root)
    return cached


# ---------------------------------------------------------------- the lock


def _lock_wait() -> float:
    try:
        return float(os.environ.get("RL_MSPROBE_LOCK_WAIT", LOCK_WAIT_S))
    except ValueError:
        return LOCK_WAIT_S


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _try_lock(state: Path) -> int | None:
    """An fd holding the lock, or None when another process holds it."""
    path = state / LOCK
    for attempt in range(100):
        try:
            state.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder was removed by a run that just finished: make it again
            if attempt < 99:
                continue
            raise UserError(
                f"{state}: could not be created; check the tree's folder and run again."
            ) from None
        except OSError as exc:
            raise UserError(
                f"{state}: cannot hold rl-msprobe's lock and journal ({exc.strerror}); make it writable "
                "(or free some space) and run again. Nothing was changed."
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the file we locked must still be the one at `path` (a finishing run may have removed it)
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    return None


@contextmanager
def tree_lock(state: Path, wait: bool = True) -> Iterator[int | None]:
    """Hold the tree's lock (fcntl); after LOCK_WAIT_S, refuse naming the holder's pid.

    wait=False yields None instead of refusing (status reads without the lock).
    """
    deadline = time.monotonic() + _lock_wait()
    fd = _try_lock(state)
    while fd is None and wait and time.monotonic() < deadline:
        time.sleep(0.05)
        fd = _try_lock(state)
    if fd is None and wait:
        raise UserError(
            f"another rl-msprobe is patching this tree (pid {_holder(state / LOCK)}); wait for it to finish, "
            "then run again."
        )
    if fd is None:
        yield None
        return
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # the pid is only for the message of a waiting run
        yield fd
    finally:
        _release(state, fd)


def _release(state: Path, fd: int) -> None:
    """Unlock and remove the lock file (a waiting run notices and locks afresh); an empty folder goes too,
    so the tree is left as it was found."""
    try:
        (state / LOCK).unlink()
        if not any(state.iterdir()):
            state.rmdir()
    except OSError:
        pass
    finally:
        os.close(fd)


def holder(state: Path) -> str | None:
    """The pid holding the tree's lock now, or None when it is free (status reports it)."""
    if not (state / LOCK).exists():
        return None
    fd = os.open(state / LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(state / LOCK)
    finally:
        os.close(fd)
    return None


# ---------------------------------------------------------------- the journal


@dataclass(frozen=True)
class Entry:
    """One file an operation changes: its path (absolute, as written) and bytes before and after."""

    path: Path
    before: bytes | None
    after: bytes | None
    label: str  # how the user knows it (tree-relative path, or the state file's name)


def begin(state: Path, op: str, entries: list[Entry], extra: dict[str, Any]) -> None:
    """Record the operation durably before anything of it happens; refuses (exit 2) when it cannot."""
    global _faulting
    _faulting = False
    folder = state / JOURNAL
    try:
        checkpoint("journal-write")
        blobs = folder / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        files = []
        for entry in entries:
            for data in (entry.before, entry.after):
                digest = sha(data)
                if digest is not None and not (blobs / digest).exists():
                    write_file(blobs / digest, data, durable=True)
            files.append(
                {
                    "path": str(entry.path),
                    "label": entry.label,
                    "before": sha(entry.before),
                    "after": sha(entry.after),
                }
            )
        doc = {"op": op, "pid": os.getpid(), "started": time.time(), "files": files, **extra}
        write_file(folder / "journal.json", json.dumps(doc, indent=1).encode(), durable=True)
    except OSError as exc:
        try:
            _drop(folder)
        except OSError:
            pass  # a partial journal without journal.json is dropped by the next run
        raise UserError(
            f"{state}: could not record the {op} before doing it ({exc.strerror}); make room or make it "
            "writable and run again. Nothing was changed."
        ) from exc


def load(state: Path) -> dict[str, Any] | None:
    path = state / JOURNAL / "journal.json"
    if not path.is_file():
        if path.parent.exists():  # killed while recording or dropping: nothing was written yet, or all was
            _drop(path.parent)
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
            raise ValueError("not a journal")
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path}: unreadable rl-msprobe journal ({exc}); check the tree by hand, then remove {path.parent}."
        ) from exc
    return doc


def finish(state: Path) -> None:
    """The operation is complete: drop its journal."""
    _drop(state / JOURNAL)


def _drop(folder: Path) -> None:
    import shutil

    path = folder / "journal.json"
    if path.exists():
        path.unlink()
        fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def blob(state: Path, digest: str | None) -> bytes | None:
    if digest is None:
        return None
    return (state / JOURNAL / "blobs" / digest).read_bytes()


def roll_back_files(state: Path, doc: dict[str, Any]) -> list[str]:
    """Every file of the journal back to its bytes before; refuses to undo a file someone changed since."""
    checkpoint("rollback")
    changed = []
    for item in doc["files"]:
        path = Path(item["path"])
        current = sha(read(path))
        if current not in (item["before"], item["after"]):
            raise UserError(
                f"{item['label']} ({path}) changed after an interrupted rl-msprobe {doc['op']} (pid {doc['pid']}); "
                f"rl-msprobe will not overwrite it. Put it right by hand, then remove {state / JOURNAL}."
            )
    for item in reversed(doc["files"]):
        path = Path(item["path"])
        _remove_temporaries(path)
        if sha(read(path)) != item["before"]:
            write_file(path, blob(state, item["before"]))
            changed.append(item["label"])
    return changed


def _remove_temporaries(path: Path) -> None:
    """The temporary files `write_file` makes beside `path` (a run killed mid-write leaves one)."""
    real = path.resolve() if path.is_symlink() else path
    folder = real.parent
    pattern = re.compile(rf"\.{re.escape(real.name)}\.[a-z0-9_]{{8}}")
    if folder.is_dir():
        for sibling in folder.iterdir():
            if pattern.fullmatch(sibling.name) and sibling.is_file():
                sibling.unlink()

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
from rl_msprobe.upstream.release_cache import cache_dir

STATE_DIR = ".rl-msprobe"
LOCK = "lock"
JOURNAL = "journal"
LOCK_WAIT_S = 5.0


# ---------------------------------------------------------------- test hook


def checkpoint(step: str) -> None:
    """A named step of apply/revert; tests make the tool stop here (never set in normal use).

    RL_MSPROBE_STEPS_LOG=FILE appends each step's name; RL_MSPROBE_FAULT_AT=STEP with
    RL_MSPROBE_FAULT=kill (default: SIGKILL itself), int (SIGINT itself, as Ctrl-C), pause (wait to be killed) or enospc
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
    if action == "int":  # one Ctrl-C at this step: KeyboardInterrupt wherever Python is when it lands
        os.environ["RL_MSPROBE_FAULT_AT"] = ""
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
        return
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
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise
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
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and (exc.filename is None or exc.filename == tmp):
            exc.filename = str(path)  # a full disk names the file the user knows, not the temporary one
        raise
    if durable:
        fsync_dir(path.parent)


def sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def read(path: Path) -> bytes | None:
    """The file's bytes; None when there is none. A FIFO, a device or a folder where a file should be is
    refused naming it (never taken for an absent file that a write would then replace), and so is a
    file past `bounded.SOURCE` (no source file of a patched tree comes near it)."""
    from rl_msprobe import bounded

    if not os.path.lexists(path) or (path.is_symlink() and not path.exists()):
        return None
    try:
        return bounded.read_bytes(path, "file", bounded.SOURCE)
    except UserError as exc:
        if not os.path.exists(path):
            return None  # removed meanwhile
        raise UserError(f"{exc} Nothing was changed.") from None


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
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError:
        return "?"
    with os.fdopen(fd, "rb") as handle:
        text = handle.read(32).decode(errors="replace").strip()
    return text if text.isdigit() else "?"


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def check_state_dir(state: Path) -> None:
    """The state folder must be a real folder of this user that nobody else may write into: the lock,
    the journal and the originals in it are trusted by the next command."""
    info = os.lstat(state)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symlink or not a folder"
    elif info.st_uid != os.geteuid() and os.geteuid() != 0:
        problem = f"belongs to another user (uid {info.st_uid})"
    elif info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        problem = "can be written by every user (o+w)"
    if problem:
        raise UserError(
            f"{state}: rl-msprobe's state folder {problem}, so its lock and journal cannot be trusted; remove it "
            "(or fix its owner and mode: chmod o-w) and run again. Nothing was changed."
        )


def _try_lock(state: Path) -> int | None:
    """An fd holding the lock, or None when another process holds it."""
    path = state / LOCK
    for attempt in range(100):
        try:
            state.mkdir(parents=True, exist_ok=True)
            check_state_dir(state)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file", str(path))
        except FileNotFoundError:  # the folder was removed by a run that just finished: make it again
            if attempt < 99:
                continue
            raise UserError(
                f"{state}: could not be created; check the tree's folder and run again."
            ) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EINVAL):  # O_NOFOLLOW: the lock is a link (or not a file)
                raise UserError(
                    f"{path}: rl-msprobe's lock file is a symlink or not a regular file; rl-msprobe never opens "
                    "it through a link (that would overwrite the link's target). Remove it and run again. "
                    "Nothing was changed."
                ) from None
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
    try:
        fd = os.open(state / LOCK, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError:
        return None
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


def _relative(path: Path, state: Path, root: Path) -> tuple[str, str]:
    """Where an entry's file lives, as the journal records it: ("state" | "tree", relative posix path)."""
    for base, folder in (("state", state), ("tree", root)):
        try:
            return base, Path(os.path.abspath(path)).relative_to(os.path.abspath(folder)).as_posix()
        except ValueError:
            continue
    raise ValueError(f"{path}: neither in the tree {root} nor in its state folder {state}")


def begin(state: Path, root: Path, op: str, entries: list[Entry], extra: dict[str, Any]) -> None:
    """Record the operation durably before anything of it happens; refuses (exit 2) when it cannot.

    Paths are recorded relative to the tree (or the state folder), never absolute: a journal is
    read back as untrusted input (`resolve`)."""
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
            base, rel = _relative(entry.path, state, root)
            files.append(
                {
                    "base": base,
                    "path": rel,
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


_DIGEST = re.compile(r"[0-9a-f]{64}")


def load(state: Path) -> dict[str, Any] | None:
    """The unfinished journal of the state folder (None: none), its shape checked: it is read back as
    untrusted input (a tree from a tarball or a shared folder may carry one)."""
    from rl_msprobe import bounded

    path = state / JOURNAL / "journal.json"
    if not path.is_file():
        if path.parent.exists():  # killed while recording or dropping: nothing was written yet, or all was
            _drop(path.parent)
        return None
    try:
        doc = json.loads(bounded.read_bytes(path, "rl-msprobe journal", bounded.CONFIG))
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
            raise ValueError("not a journal")
        for item in doc["files"]:
            ok = isinstance(item, dict) and all(isinstance(item.get(k), str) for k in ("path", "label"))
            digests = [item.get("before"), item.get("after")] if ok else []
            if not ok or not all(d is None or (isinstance(d, str) and _DIGEST.fullmatch(d)) for d in digests):
                raise ValueError(f"entry {item!r:.80} is not one rl-msprobe writes")
        doc.setdefault("op", "operation")
        doc.setdefault("pid", "?")
    except (OSError, ValueError, RecursionError, UserError) as exc:
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
    """A journal blob, verified against its sha256 (a blob cut short or swapped is never restored)."""
    if digest is None:
        return None
    path = state / JOURNAL / "blobs" / digest
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read() if stat.S_ISREG(os.fstat(handle.fileno()).st_mode) else None
    except OSError:
        data = None
    if data is None or sha(data) != digest:
        raise UserError(
            f"{path}: the saved copy is missing or does not match its sha256 (cut short or changed), so the file "
            f"it holds cannot be restored from it. Nothing was written; check the tree by hand, then remove "
            f"{state / JOURNAL}."
        )
    return data


def resolve(state: Path, root: Path, item: dict[str, Any]) -> Path:
    """The file a journal entry names, confined to the tree (or the state folder): an absolute path,
    `..` or a link out of it is refused, so a planted journal cannot make rl-msprobe write elsewhere."""
    base = state if item.get("base") == "state" else root
    rel = item["path"]
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or "base" not in item:
        raise UserError(
            f"{state / JOURNAL / 'journal.json'}: names {rel!r}, which is not a path inside {base}; rl-msprobe "
            f"never writes outside the tree it patches. Nothing was written; remove {state / JOURNAL}."
        )
    path: Path = base / rel
    real, top = os.path.realpath(path), os.path.realpath(base)
    if os.path.commonpath([real, top]) != top:
        raise UserError(
            f"{state / JOURNAL / 'journal.json'}: {rel!r} leads out of {base} (to {real}) through a link; "
            f"rl-msprobe never writes outside the tree it patches. Nothing was written; remove {state / JOURNAL}."
        )
    return path


def roll_back_files(state: Path, root: Path, doc: dict[str, Any]) -> list[str]:
    """Every file of the journal back to its bytes before; refuses to undo a file someone changed since.
    Every path and blob is checked before the first byte is written."""
    checkpoint("rollback")
    changed = []
    paths = [resolve(state, root, item) for item in doc["files"]]
    restore = []
    for item, path in zip(doc["files"], paths):
        current = sha(read(path))
        if current not in (item["before"], item["after"]):
            raise UserError(
                f"{item['label']} ({path}) changed after an interrupted rl-msprobe {doc['op']} (pid {doc['pid']}); "
                f"rl-msprobe will not overwrite it. Put it right by hand, then remove {state / JOURNAL}."
            )
        if current != item["before"]:
            restore.append((item, path, blob(state, item["before"])))
    for item, path, data in reversed(restore):
        _remove_temporaries(path)
        write_file(path, data)
        changed.append(item["label"])
    for path in paths:
        _remove_temporaries(path)
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

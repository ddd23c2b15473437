"""One publish step for every output of several files (`prepare`'s script and configs, a report
folder): all of the new files, or the old ones, never some of each.

1. `stage`: each file is written to a new temporary entry beside its name (O_CREAT | O_EXCL |
   O_NOFOLLOW; a name already there, a link included, is never written through).
2. `commit`: an intent (`.rl-msprobe-publishing.json` in the home folder) lists every name, its
   temporary entry, where the file it replaces is kept, and the sha256 of the new record. Then
   each old file is renamed aside and the new one renamed in, the record (the caller's list of
   what rl-msprobe wrote, with their sha256) last: the commit point. Then the old files and the
   intent go.
3. Any failure before the commit point renames the old files back and removes the new ones
   (renames and unlinks only, so it works on a full disk): the folder is as before. A run killed
   part-way leaves the intent; the next run in that folder (`recover`) finishes it when the
   record is in place, else puts the old files back, and removes what that run left.

A folder rl-msprobe owns whole (`dumps compare`'s `pairs/`) is built in a temporary sibling
(`stage_folder`) and renamed into place as a unit (`swap_folder`: the old folder aside, the new in,
the old removed); `recover_folder` gives a killed swap its old folder back.

Every write, create and rename goes through `_create`, `_write`, `_rename` and `_rename_path`, so
tests make each fail at every call in turn.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.errors import UserError

INTENT = ".rl-msprobe-publishing.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_LEFTOVER = re.compile(
    r"^\..+\.rl-msprobe-(\d+)\.(tmp|old)$"
)  # a run's temporary or kept-aside entry (its pid)


def _aside(name: str, kind: str) -> str:
    """This run's temporary ("tmp") or kept-aside ("old") entry for `name`: marked as rl-msprobe's."""
    return f".{name}.rl-msprobe-{os.getpid()}.{kind}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- the file system calls (tests fail them)


def _create(name: str, folder: int, mode: int) -> int:
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=folder)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _rename(src: str, dst: str, folder: int) -> None:
    os.replace(src, dst, src_dir_fd=folder, dst_dir_fd=folder)


def _unlink(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass  # gone already, or left for the next run's `recover` to take away


def _exists(name: str, folder: int) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def parse_record(data: bytes | None) -> dict[str, str]:
    """The caller's record of what rl-msprobe wrote (`{"files": {name: sha256}}`) read back; anything
    unreadable counts as an empty record, so no file in the way is taken for ours."""
    try:
        files = json.loads(data or b"{}").get("files", {})
    except (ValueError, AttributeError, RecursionError):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {}


def record_bytes(files: dict[str, str]) -> bytes:
    """A record of what rl-msprobe wrote (name -> sha256), as `parse_record` reads it back."""
    return (json.dumps({"files": files}, indent=1) + "\n").encode()


def read_own(name: str, folder: int, limit: int = 1 << 26) -> bytes | None:
    """A regular file of the folder, never through a link (None: absent, a link, too large)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        return handle.read(limit + 1)


def write_new(name: str, folder: int, data: bytes, mode: int = 0o644) -> None:
    """`data` into a new entry `name` of the folder (it must not exist); on a failure it is removed."""
    fd = _create(name, folder, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=True) as handle:
            _write(handle.fileno(), data)
            os.fchmod(handle.fileno(), mode)
    except BaseException:
        _unlink(name, folder)
        raise


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- one publication


@dataclass
class Item:
    """One file of the output: its folder (descriptor and path), its name there, and the sha256 of
    what was staged for it in `tmp`."""

    folder: int
    where: str
    name: str
    tmp: str
    digest: str
    old: str | None = None  # where the file it replaces is kept while the publication runs


@dataclass
class Publication:
    """The files of one output, staged, then committed all together (`home`: the folder of the
    record and the intent; its descriptor is the caller's and stays open as long as this)."""

    home: int
    home_path: str
    items: list[Item] = field(default_factory=list)

    def stage(self, folder: int, where: str, name: str, data: bytes, mode: int = 0o644) -> None:
        """Write `data` for `name` into a new temporary entry of `folder` (OSError: nothing kept of it)."""
        if any(i.name == name and i.where == where for i in self.items):
            raise ValueError(f"{name!r} is staged already")
        tmp = _aside(name, "tmp")
        _unlink(tmp, folder)  # this process's own, from an earlier publication
        try:
            write_new(tmp, folder, data, mode)
        except OSError as exc:
            exc.filename = os.path.join(where, name)  # the file the user knows, not the temporary entry
            raise
        self.items.append(Item(folder, where, name, tmp, sha(data)))

    def discard(self) -> None:
        """Every staged entry removed: each folder holds exactly what it held before."""
        for item in self.items:
            _unlink(item.tmp, item.folder)
        self.items.clear()

    def commit(self, record_name: str, record: bytes) -> None:
        """Every staged file takes its name, the record (`record_name` in home) last; on any
        failure every name is as before (OSError, or UserError when even that failed)."""
        try:
            self.stage(self.home, self.home_path, record_name, record)
        except OSError:
            self.discard()
            raise
        for item in self.items:
            item.old = _aside(item.name, "old") if _exists(item.name, item.folder) else None
        try:
            intent = {"pid": os.getpid(), "items": [_describe(i) for i in self.items]}
            _unlink(_aside(INTENT, "tmp"), self.home)
            write_new(_aside(INTENT, "tmp"), self.home, json.dumps(intent).encode())
            _rename(_aside(INTENT, "tmp"), INTENT, self.home)
        except OSError as exc:
            _unlink(_aside(INTENT, "tmp"), self.home)
            self.discard()
            exc.filename = os.path.join(self.home_path, INTENT)
            raise
        try:
            for item in self.items:  # the record is the last item: the commit point
                try:
                    if item.old:
                        _rename(item.name, item.old, item.folder)
                    _rename(item.tmp, item.name, item.folder)
                except OSError as exc:
                    exc.filename = os.path.join(item.where, item.name)
                    raise
        except BaseException as exc:  # a failed rename, or Ctrl-C: the old files back now
            problem = _roll_back(self.items)
            if problem:
                raise UserError(
                    f"{getattr(exc, 'filename', None) or self.home_path}: could not be put in place "
                    f"({getattr(exc, 'strerror', None) or exc!r}), and putting the "
                    f"old files back failed too ({problem}); the next rl-msprobe run in {self.home_path} finishes "
                    "that."
                ) from exc
            _unlink(INTENT, self.home)
            self.items.clear()
            raise
        _tidy(self.items, self.home)
        self.items.clear()


def _describe(item: Item) -> dict[str, Any]:
    return {"where": item.where, "name": item.name, "tmp": item.tmp, "old": item.old, "sha": item.digest}


def _roll_back(items: list[Item]) -> str | None:
    """Old files back under their names, new ones out (renames and unlinks: room is never needed).
    None, or what could not be done."""
    problem = None
    for item in reversed(items):
        try:
            data = read_own(item.name, item.folder)
            ours = data is not None and sha(data) == item.digest  # never a file someone changed since
            if item.old and _exists(item.old, item.folder):
                if ours or not _exists(item.name, item.folder):
                    _rename(item.old, item.name, item.folder)
                else:
                    problem = (
                        problem
                        or f"{item.where}/{item.name}: changed since (kept; the old file is {item.old})"
                    )
                    continue
            elif not item.old and ours:
                _rename(item.name, item.tmp, item.folder)
        except OSError as exc:
            problem = problem or f"{item.where}/{item.name}: {exc.strerror}"
        _unlink(item.tmp, item.folder)
    return problem


def _tidy(items: list[Item], home: int) -> None:
    """After the commit point: the kept-aside old files and the intent go."""
    for item in items:
        if item.old:
            _unlink(item.old, item.folder)
        _unlink(item.tmp, item.folder)
    _unlink(INTENT, home)


# ---------------------------------------------------------------- the next run


def recover(home: int, home_path: str) -> str | None:
    """A publication in `home` that a kill cut short: finished when its record is in place, else
    the old files put back; what that run left is removed, and so are the temporary entries of
    runs no longer alive (a kill while staging). Returns what was done (None: nothing)."""
    raw = read_own(INTENT, home, 1 << 24)
    outcome = None
    if raw is not None:
        try:
            doc = json.loads(raw)
            pid = int(doc["pid"])
            described = list(doc["items"])
        except (ValueError, KeyError, TypeError):
            described, pid = [], -1
        if pid not in (-1, os.getpid()) and _pid_alive(pid) and _recent(home):
            raise UserError(
                f"{home_path}: rl-msprobe (pid {pid}) is writing its outputs there; wait for it to end and run "
                "again. Nothing was written."
            )
        items, folders = _items(described, home, home_path)
        try:
            # done: every name holds its new file (the record renamed in last, so it was not cut short)
            done = bool(items) and all(_holds(i) for i in items)
            if done:
                _tidy(items, home)
                outcome = "finished"
            else:
                problem = _roll_back(items)
                if problem:
                    raise UserError(
                        f"{home_path}: an interrupted rl-msprobe run left its outputs half in place, and putting "
                        f"the old files back failed ({problem}); fix that and run again."
                    )
                _unlink(INTENT, home)
                outcome = "put back"
        finally:
            for fd in folders:
                os.close(fd)
    _sweep(home)
    return outcome


def _recent(home: int, seconds: float = 60.0) -> bool:
    """The intent was written moments ago (a publication takes milliseconds: an old one whose pid
    is alive is another process's reused pid)."""
    try:
        return time.time() - os.stat(INTENT, dir_fd=home, follow_symlinks=False).st_mtime < seconds
    except OSError:
        return False


def _holds(item: Item) -> bool:
    data = read_own(item.name, item.folder)
    return data is not None and sha(data) == item.digest and not _exists(item.tmp, item.folder)


def _items(described: list[Any], home: int, home_path: str) -> tuple[list[Item], list[int]]:
    """The intent's items, each with its folder opened (those outside home: opened here)."""
    items, opened = [], []
    for entry in described:
        try:
            where, name, tmp, old, digest = (
                entry["where"],
                entry["name"],
                entry["tmp"],
                entry["old"],
                entry["sha"],
            )
        except (KeyError, TypeError):
            continue
        if not all(isinstance(x, str) and "/" not in x for x in (name, tmp, *([old] if old else []))):
            continue
        if os.path.abspath(where) == os.path.abspath(home_path):
            folder = home
        else:
            try:
                folder = os.open(where, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
            except OSError:
                continue
            opened.append(folder)
        items.append(Item(folder, where, name, tmp, str(digest), old))
    return items, opened


def _sweep(home: int) -> None:
    """rl-msprobe's temporary and kept-aside entries of runs no longer alive."""
    try:
        listed = os.listdir(home)
    except OSError:
        return
    for name in listed:
        match = _LEFTOVER.match(name)
        if match and not _pid_alive(int(match.group(1))):
            info = os.stat(name, dir_fd=home, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
                _unlink(name, home)


def publish_paths(files: list[tuple[Path, bytes, int]], home: Path, record_name: str, record: bytes) -> None:
    """Publish files given by path (each folder opened here; made when missing), the record in `home`."""
    folders: dict[str, int] = {}
    try:
        for path, _, _ in [*files, (home / record_name, b"", 0)]:
            where = os.path.dirname(os.path.abspath(path))
            if where not in folders:
                os.makedirs(where, exist_ok=True)
                folders[where] = os.open(where, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        home_path = os.path.abspath(home)
        for where, fd in folders.items():
            if where != home_path:
                _sweep(fd)
        recover(folders[home_path], home_path)
        publication = Publication(folders[home_path], home_path)
        try:
            for path, data, mode in files:
                where = os.path.dirname(os.path.abspath(path))
                publication.stage(folders[where], where, os.path.basename(path), data, mode)
        except BaseException:
            publication.discard()
            raise
        publication.commit(record_name, record)
    finally:
        for fd in folders.values():
            os.close(fd)


def recover_at(home: Path) -> str | None:
    """`recover` in the folder `home` (nothing to do when it does not exist yet)."""
    try:
        fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError:
        return None
    try:
        return recover(fd, os.path.abspath(home))
    finally:
        os.close(fd)


# ---------------------------------------------------------------- a folder rl-msprobe owns whole


def _rename_path(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def stage_folder(final: Path) -> Path:
    """A new, empty temporary sibling of `final` to build this run's folder in (`swap_folder` puts
    it in place as a unit). What killed runs left beside `final` is dealt with first."""
    recover_folder(final)
    staging = final.parent / _aside(final.name, "tmp")
    if os.path.lexists(staging):
        _remove(staging)
    staging.mkdir(parents=True)
    return staging


def swap_folder(staging: Path, final: Path) -> None:
    """`staging` takes the name `final` (renames only): the old folder is renamed aside, the new one in,
    then the old one removed. A failure puts the old folder back; the new one is removed."""
    old = final.parent / _aside(final.name, "old")
    had = os.path.lexists(final)
    try:
        if had:
            _rename_path(final, old)
        try:
            _rename_path(staging, final)
        except BaseException:
            if had:
                _rename_path(old, final)
            raise
    except BaseException:
        _remove(staging)
        raise
    if had:
        _remove(old)


def recover_folder(final: Path) -> None:
    """Beside `final`: a run killed in the middle of `swap_folder` (its old folder aside, `final`
    missing) gets its old folder back; the temporary folders of runs no longer alive go."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.rl-msprobe-(\d+)\.(tmp|old)$")
    try:
        names = sorted(os.listdir(final.parent), key=lambda n: not n.endswith(".old"))
    except OSError:
        return
    for name in names:
        match = pattern.match(name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        path = final.parent / name
        if match.group(2) == "old" and not os.path.lexists(final):
            _rename_path(path, final)
        else:
            _remove(path)


def discard_folder(staging: Path) -> None:
    """This run's temporary folder, given up (the folder it was to replace stays as it was)."""
    _remove(staging)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass

"""A report folder (`--out`) written only through files the command itself creates there.

`mismatch report` and `dumps compare` write report.md, summary.json, PNGs... into a folder the
user names, often one that already holds things. So: the folder is opened once (its descriptor is
kept, so swapping it for a link half-way changes nothing) and must belong to the user and not be
writable by others; every file is made as a new temporary entry (O_CREAT | O_EXCL | O_NOFOLLOW)
and at the end all of them take their names in one publish step (`publishing`: the old files or
the new, never some of each), so a symlink planted as `summary.json` is replaced, never written
through. A file already there is replaced only when this tool wrote it and nobody changed it since
(`.rl-msprobe-report.json` keeps their sha256, as `prepare` does); anything else in the way is
refused before the first byte unless --force.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from rl_msprobe import bounded, publishing
from rl_msprobe.errors import UserError

RECORD = ".rl-msprobe-report.json"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ReportFolder:
    """The --out folder of one command: `claim` the names first (refusing before anything is written),
    then `write` each file, then `close` (records what was written)."""

    def __init__(self, path: Path, force: bool = False, option: str = "--out") -> None:
        self.path = Path(os.path.abspath(path))
        self.force = force
        self.option = option
        self.written: dict[str, str] = {}
        self.staged: dict[str, str] = {}  # name -> its temporary entry (publishing)
        self.shas: dict[str, str] = {}  # name -> the sha256 of what was staged for it
        self.fd = self._open()
        self.record = self._load_record()
        try:  # a run killed while putting its report in place: its files finished, or the old ones back
            publishing.recover(self.fd, str(self.path))
        except BaseException:
            os.close(self.fd)
            raise
        self.record = self._load_record()
        self.publication = publishing.Publication(self.fd, str(self.path))

    # ------------------------------------------------------------ the folder

    def _open(self) -> int:
        path = self.path
        if os.path.lexists(path) and not os.path.isdir(path):
            raise UserError(f"{path}: exists and is not a folder. Choose another {self.option}.")
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise UserError(
                f"{path}: cannot be made or opened as the report folder ({exc.strerror}); choose another "
                f"{self.option}. Nothing was written."
            ) from None
        info = os.fstat(fd)
        problem = None
        if info.st_uid not in (os.geteuid(), 0):
            problem = f"belongs to another user (uid {info.st_uid})"
        elif info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            problem = "can be written by every user (mode o+w without the sticky bit)"
        if problem:
            os.close(fd)
            raise UserError(
                f"{path}: {problem}, so what rl-msprobe writes there could be swapped by someone else; choose "
                f"a folder of your own as {self.option}. Nothing was written."
            )
        return fd

    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _read_own(self, name: str, limit: int) -> bytes | None:
        """A regular file of the folder, never through a link (None when absent, a link or too large)."""
        return publishing.read_own(name, self.fd, limit)

    def _load_record(self) -> dict[str, str]:
        return publishing.parse_record(self._read_own(RECORD, bounded.CONFIG))

    # ------------------------------------------------------------ writing

    def ours(self, name: str) -> bool:
        """The entry `name` is a file this tool wrote there and nobody changed since."""
        info = self._lstat(name)
        if info is None or not stat.S_ISREG(info.st_mode) or name not in self.record:
            return False
        data = self._read_own(name, info.st_size)
        return data is not None and publishing.sha(data) == self.record[name]

    def claim(self, names: Iterable[str]) -> None:
        """Refuse (exit 2, nothing written) when any of `names` is in the folder and is not ours,
        unless --force."""
        theirs = [name for name in names if self._lstat(name) is not None and not self.ours(name)]
        if theirs and not self.force:
            shown = ", ".join(str(self.path / n) for n in theirs[:5]) + (" ..." if len(theirs) > 5 else "")
            raise UserError(
                f"{shown}: already there and not written by rl-msprobe (or changed since, or a link); move "
                f"it away, choose another {self.option}, or pass --force to replace it. Nothing was written."
            )

    def write(self, name: str, data: bytes | str, mode: int = 0o644) -> Path:
        """Stage `data` for `name` (a plain file name in the folder) in a new entry of its own; every
        staged file takes its name at `commit`, all together. Returns the path it will have."""
        if isinstance(data, str):
            # a file or folder name that is not UTF-8 (held as surrogates) is shown escaped, as `\udcff`
            data = data.encode("utf-8", "backslashreplace")
        if "/" in name or name in ("", ".", "..", RECORD, publishing.INTENT) or name in self.staged:
            raise ValueError(f"not a new plain file name: {name!r}")
        try:
            self.publication.stage(self.fd, str(self.path), name, data, mode)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"{self.path / name}: could not be written ({exc.strerror}); free some space or choose another "
                f"{self.option}. Nothing was written."
            ) from None
        self.staged[name] = self.publication.items[-1].tmp
        self.shas[name] = publishing.sha(data)
        return self.path / name

    def commit(self) -> None:
        """Refuse when a staged name is taken by a file that is not ours (unless --force); else every
        staged file takes its name and the record follows, in one publish step (`publishing`): an
        interruption leaves the old files or the new ones, never some of each. A link in the way
        is replaced, never followed."""
        if not self.staged:
            return
        try:
            self.claim(self.staged)
        except BaseException:
            self.discard()
            raise
        record = publishing.record_bytes({**self.record, **self.shas})
        try:
            self.publication.commit(RECORD, record)
        except OSError as exc:
            self.staged.clear()
            raise UserError(
                f"{exc.filename or self.path}: the report could not be put in place ({exc.strerror}); the "
                f"folder is as it was. Free some space or choose another {self.option}. Nothing was written."
            ) from None
        self.written.update(self.shas)
        self.record.update(self.shas)
        self.staged.clear()
        self.shas.clear()

    def discard(self) -> None:
        """Remove every staged entry (the folder keeps exactly what it had)."""
        self.publication.discard()
        self.staged.clear()
        self.shas.clear()

    def close(self) -> None:
        self.discard()
        os.close(self.fd)

    def __enter__(self) -> ReportFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if kind is None:
                self.commit()
        finally:
            self.close()

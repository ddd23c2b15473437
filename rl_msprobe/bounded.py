"""Reading files a user names (or a folder holds) without hanging and without exhausting memory.

Every reader of user input goes through here: only regular files are opened (a FIFO would block
forever, `/dev/zero` never ends, a socket cannot be read), refused by type before opening and checked
again on the open descriptor; whole files and single lines have size limits, and a refusal names the
file, what it was expected to be and the limit. Nothing here parses: callers get bytes or lines.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO

from rl_msprobe.errors import UserError

MiB = 1 << 20
# far above what a real run writes, far below what would hurt a laptop
LAUNCH_SCRIPT = 4 * MiB  # verl's launch scripts are a few KB; the reader is linear (~1.5 s a MB)
SOURCE = 64 * MiB  # a Python source file of a patched tree (vLLM's largest are ~300 KB)
CONFIG = 16 * MiB  # a YAML / JSON config, a manifest, a record
DUMP_JSON = 1024 * MiB  # msprobe's dump.json of a large model at statistics level is ~100s of MB
LOG_LINE = 64 * MiB  # one JSONL line: a triage line of a 32k-token response is ~2 MB


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_kind(path: Path | str, kind: str, what: str) -> UserError:
    return UserError(f"{path}: is {kind}, not a regular file; pass the {what} itself.")


def size_text(n: int) -> str:
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n:,} bytes"


def regular(path: Path | str, what: str) -> os.stat_result:
    """The file's stat when it is a regular file (links followed); UserError naming what it is otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file. Pass the {what}.") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}); pass a readable {what}.") from None
    kind = _kind(info.st_mode)
    if kind is not None:
        raise _refuse_kind(path, kind, what)
    return info


@contextmanager
def open_regular(path: Path | str, what: str, limit: int | None = None) -> Iterator[BinaryIO]:
    """A binary file object for a regular file of at most `limit` bytes (None: any size, for streams).

    The type is checked before opening and again on the descriptor (opened non-blocking, so a file
    swapped for a FIFO in between cannot hang the open either)."""
    info = regular(path, what)
    _check_size(path, info.st_size, limit, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}); pass a readable {what}.") from None
    try:
        info = os.fstat(fd)
        kind = _kind(info.st_mode)
        if kind is not None:
            raise _refuse_kind(path, kind, what)
        _check_size(path, info.st_size, limit, what)
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


@contextmanager
def open_text(path: Path | str, what: str, limit: int | None = None) -> Iterator[TextIO]:
    """`open_regular` as UTF-8 text with newlines as written (what the csv module wants)."""
    with open_regular(path, what, limit) as handle:
        yield io.TextIOWrapper(handle, encoding="utf-8", newline="")


def _check_size(path: Path | str, size: int, limit: int | None, what: str) -> None:
    if limit is not None and size > limit:
        raise UserError(
            f"{path}: {size_text(size)}, more than the {size_text(limit)} a {what} may have here; "
            "pass the right file (or cut it down)."
        )


def read_bytes(path: Path | str, what: str, limit: int) -> bytes:
    """The whole regular file, at most `limit` bytes (a file growing past it while read is refused too)."""
    with open_regular(path, what, limit) as handle:
        chunks, total = [], 0
        try:
            want = os.fstat(handle.fileno()).st_size + 1  # never a buffer of `limit` bytes up front
            while total <= limit:
                chunk = handle.read(min(want, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                want = 1 << 20
        except OSError as exc:
            raise UserError(f"{path}: cannot be read ({exc.strerror}); pass a readable {what}.") from None
    _check_size(path, total, limit, what)
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def read_text(path: Path | str, what: str, limit: int) -> str:
    """The whole regular file as UTF-8; invalid UTF-8 is refused naming the byte and line."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte {exc.start}); pass the {what} itself, saved as UTF-8."
        ) from None


def lines(handle: BinaryIO, path: Path | str, what: str, limit: int = LOG_LINE) -> Iterator[bytes]:
    """The lines of an open file, each at most `limit` bytes: a longer one is refused naming its number
    (a file with no newline at all would otherwise be read whole into memory)."""
    number = 0
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit:
            raise UserError(
                f"{path}:{number}: a line longer than {size_text(limit)}; not a {what} line rl-msprobe's "
                "helpers write. Remove that line (or pass the folder the run wrote)."
            )
        yield line


def bounded_int(value: int, limit: int, where: str, what: str) -> int:
    """`value` when 0 <= value <= limit; else UserError naming where it came from and the limit."""
    if not 0 <= value <= limit:
        shown = str(value) if value.bit_length() <= 96 else f"of {value.bit_length()} bits"
        raise UserError(
            f"{where}: {what} {shown} is outside "
            f"0..{limit:,}, more than a real run produces; the file was edited or is not one rl-msprobe's "
            "helpers wrote."
        )
    return value

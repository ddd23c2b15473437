"""Reading the files of a tree: raw bytes, and text rl-msprobe is willing to patch."""

from __future__ import annotations

import codecs
import os
import re
import subprocess
from pathlib import Path

from rl_msprobe.engine import journal
from rl_msprobe.errors import UserError
from rl_msprobe.patches import shape


def decode(data: bytes, path: str) -> str:
    if data.startswith(codecs.BOM_UTF8):
        raise UserError(
            f"{path}: starts with a UTF-8 byte-order mark; rl-msprobe patches plain UTF-8 sources. Remove the "
            "mark (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' FILE`) and run again."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text (byte {exc.start}); rl-msprobe only patches UTF-8 sources."
        ) from exc
    lone_cr = re.search("\r(?!\n)", text)
    if lone_cr:
        line = text.count("\n", 0, lone_cr.start()) + 1
        raise UserError(
            f"{path}:{line}: a carriage return without a line feed (old Mac line endings); rl-msprobe patches "
            "files with LF or CRLF line endings. Convert the file (e.g. `sed -i 's/\\r/\\n/g' FILE`) and run again."
        )
    return text


def read_bytes(root: Path, rel: str) -> bytes | None:
    data = journal.read(root / rel)
    if data is None:
        _refuse_sparse(root, rel)
    return data


def text_reader(root: Path) -> shape.Reader:
    """Tree-relative path -> decoded text (None when absent), each file read once."""
    cache: dict[str, str | None] = {}

    def read(rel: str) -> str | None:
        if rel not in cache:
            data = read_bytes(root, rel)
            cache[rel] = decode(data, rel) if data is not None else None
        return cache[rel]

    return read


def _refuse_sparse(root: Path, rel: str) -> None:
    """A file git has but a sparse checkout left off the disk is not a file upstream lacks: say so
    (otherwise it reads as a tree of another version, or as the wrong --tree)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-t", "--", rel],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return
    if proc.returncode == 0 and proc.stdout.startswith("S "):
        folder = str(Path(rel).parent)
        raise UserError(
            f"{root / rel}: in git but not on disk: the sparse checkout of this repository leaves it out. "
            "rl-msprobe reads and patches the files themselves; check it out "
            f"(git -C {root} sparse-checkout add {folder}, or sparse-checkout disable) and run again. "
            "Nothing was changed."
        )


def is_ours(data: bytes) -> bool:
    """A file rl-msprobe added (its helpers carry this line near the top)."""
    return b"Added to this tree by rl-msprobe" in data[:2000]

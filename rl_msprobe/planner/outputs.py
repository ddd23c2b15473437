"""The writing step of `prepare`: the derived script and configs, never at the cost of a user's file.

A file is overwritten only when rl-msprobe wrote it and nobody changed it since: every write is
recorded (sha256) in `.rl-msprobe-prepared.json` beside the configs, and all outputs and that
record are put in place in one publish step (`publishing`). Anything else in the way (a
script of the same name, an edited config, a symlink) is refused unless --force. Paths are
resolved first, so no output can land on the original script through a symlink.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rl_msprobe import bounded, publishing
from rl_msprobe.engine import journal
from rl_msprobe.errors import UserError

RECORD = ".rl-msprobe-prepared.json"


@dataclass(frozen=True)
class Output:
    path: str
    text: str
    executable: bool = False


def _load_record(path: Path) -> dict[str, str]:
    try:
        return publishing.parse_record(
            bounded.read_bytes(path, "rl-msprobe's record of what it wrote", bounded.CONFIG)
        )
    except (OSError, UserError):
        return {}


def _key(record: Path, path: str) -> str:
    return os.path.relpath(os.path.abspath(path), record.parent)


def _ours(record: dict[str, str], key: str, path: str) -> bool:
    if os.path.islink(path):
        return False
    return record.get(key) == journal.sha(journal.read(Path(path)))


def write(outputs: list[Output], record_dir: str, original: str, original_bytes: bytes, force: bool) -> None:
    """Write every output or none of them; refuses (exit 2) before writing when any would cost user bytes."""
    record_path = Path(record_dir) / RECORD
    # a prepare killed while putting its outputs in place: finished, or the old ones back (so its
    # half-written outputs are never taken for the user's)
    publishing.recover_at(Path(record_dir))
    record = _load_record(record_path)
    real_original = os.path.realpath(original)
    for out in outputs:
        if os.path.realpath(out.path) == real_original:
            raise UserError(
                f"{out.path}: is the original script {original} (through a symlink); rl-msprobe never "
                "overwrites it. Pass --out with another folder. Nothing was written."
            )
    theirs = [
        out.path
        for out in outputs
        if os.path.lexists(out.path) and not _ours(record, _key(record_path, out.path), out.path)
    ]
    if theirs and not force:
        raise UserError(
            f"{', '.join(theirs)}: already exist{'s' if len(theirs) == 1 else ''} and rl-msprobe did not write "
            "it (or it was edited since). Move it away, pass --out DIR, or pass --force to overwrite. "
            "Nothing was written."
        )
    if journal.read(Path(original)) != original_bytes:
        raise UserError(f"{original} changed while preparing; run prepare again. Nothing was written.")
    for out in outputs:
        record[_key(record_path, out.path)] = journal.sha(out.text.encode("utf-8")) or ""
    files = [(Path(o.path), o.text.encode("utf-8"), 0o755 if o.executable else 0o644) for o in outputs]
    doc = publishing.record_bytes(record)
    try:  # every output and the record in one publish step: the old files or the new, never some of each
        publishing.publish_paths(files, Path(record_dir), RECORD, doc)
    except OSError as exc:
        raise UserError(
            f"{exc.filename or record_dir}: could not be written ({exc.strerror}); the outputs are as they "
            "were. Nothing was written."
        ) from exc

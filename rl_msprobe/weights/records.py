"""Reading what a job wrote under `<dump-dir>/weights/`: `{stage}-{host}-{pid}.jsonl`, one JSON
object per line (see verl/utils/rl_msprobe_weights.py, added by the verl-weights set).

Every line is checked; a bad one is an error naming the file, the line and the key. Hashes of
two kinds in one folder (a k64 checksum "k64:<hex>" from the current helper, a bare CRC-32 from
helpers before FORMAT 2) are never compared with each other: such a folder is refused.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe import bounded
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject
from rl_msprobe.weights import validate
from rl_msprobe.weights.fingerprint import Fingerprint

STAGES = ("sent", "received", "resident")
META = "resident-meta"
WHAT = "weights fingerprint file"
LINE_LIMIT = 1 << 20  # one tensor's line is ~400 bytes
SYNC_LIMIT = 10_000_000  # one sync per training step
RANK_LIMIT = 1_000_000
INDEX_LIMIT = 1 << 31  # a tensor's place in the model's order
FIX = validate.FIX


@dataclass(frozen=True)
class Entry:
    stage: str
    sync: int
    rank: int
    process: str  # "{host}-{pid}" from the file name: one worker or actor process
    name: str
    index: int
    dtype: str
    fp: Fingerprint | None  # None: the helper took only the checksum (lazy statistics)
    hash: str | None = None
    step: int | None = None
    how: str | None = None  # resident: "loader-written" or "parameter"
    engine_name: str | None = None
    same_as: str | None = None  # the stage whose statistics the helper reused: "received" / "sent"
    implied_by: str | None = None  # received: the stage whose checksum stood for this one ("resident")
    unreadable: bool = False
    shape: tuple[int, ...] | None = None
    reset_kept: bool = False  # resident, reset mode: the part still holds the pattern (never written)
    # received with TP > 1: this rank's chunk along dim 0 / dim 1 (what its resident shard must match)
    shards: dict[int, Fingerprint] = field(default_factory=dict)


@dataclass
class Run:
    """Everything read from one folder, grouped: stage -> sync -> process -> name -> Entry."""

    folder: Path
    entries: dict[str, dict[int, dict[str, dict[str, Entry]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict))
    )
    meta: dict[int, dict[str, JsonObject]] = field(
        default_factory=lambda: defaultdict(dict)
    )  # sync -> process -> meta
    files: int = 0

    def syncs(self) -> list[int]:
        return sorted({s for stage in self.entries.values() for s in stage} | set(self.meta))


def hash_kind(value: str) -> str:
    """The checksum that made a hash string: its prefix ("k64:..."), or "crc32" for a bare one."""
    kind, sep, _ = value.partition(":")
    return kind if sep else "crc32"


def _bad(path: Path, line: int, what: str) -> UserError:
    return UserError(f"{path}:{line}: {what}; {FIX}.")


def _whole(doc: JsonObject, key: str, path: Path, line: int, limit: int, default: int | None = None) -> int:
    """DOC[KEY] as a whole number within 0..LIMIT (DEFAULT where it is absent), else UserError naming it."""
    if key not in doc and default is not None:
        return default
    value = doc.get(key)
    if value is None:
        raise _bad(path, line, f"key {key!r} missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, line, f"{key} is {json.dumps(value)[:40]}, not a whole number")
    if value == default:  # the helpers write it too (index -1: not in the model's order)
        return value
    return bounded.bounded_int(value, limit, f"{path}:{line}", key)


def _text(doc: JsonObject, key: str, path: Path, line: int) -> str | None:
    """DOC[KEY] when it is a string (None where it is absent or null), else UserError naming it."""
    value = doc.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _bad(path, line, f"{key} is {json.dumps(value)[:40]}, not a string")


def _optional_whole(doc: JsonObject, key: str, path: Path, line: int, limit: int) -> int | None:
    return None if doc.get(key) is None else _whole(doc, key, path, line, limit)


def _check_meta(doc: JsonObject, path: Path, line: int) -> None:
    """A resident-meta line's TP size, tied names and held names as the helpers write them."""
    _optional_whole(doc, "tp_size", path, line, RANK_LIMIT)
    aliases = doc.get("aliases")
    if aliases is not None and not (
        isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())
    ):
        raise _bad(path, line, f"aliases is {json.dumps(aliases)[:40]}, not an object of tensor names")
    holds = doc.get("holds")
    if holds is not None and not isinstance(holds, list):
        raise _bad(path, line, f"holds is {json.dumps(holds)[:40]}, not a list of tensor names")


def _entry(doc: JsonObject, path: Path, line: int, process: str) -> Entry:
    try:
        sync = _whole(doc, "sync", path, line, SYNC_LIMIT)
        rank = _whole(doc, "rank", path, line, RANK_LIMIT)
        name = doc["name"]
        if not isinstance(name, str):
            raise _bad(path, line, f"name is {json.dumps(name)[:40]}, not a string")
        where = f"{path}:{line}"
        fp, count = validate.statistics(doc, where, name)
        dims = validate.shape(doc.get("shape"), count, where, name)
        tp = _optional_whole(doc, "tp_size", path, line, RANK_LIMIT)
        return Entry(
            stage=doc["stage"],
            sync=sync,
            rank=rank,
            process=process,
            name=name,
            index=_whole(doc, "index", path, line, INDEX_LIMIT, default=-1),
            dtype=validate.dtype(doc.get("dtype"), where, name),
            fp=fp,
            hash=_text(doc, "hash", path, line),
            step=_optional_whole(doc, "step", path, line, SYNC_LIMIT),
            how=_text(doc, "how", path, line),
            engine_name=_text(doc, "engine_name", path, line),
            same_as=_text(doc, "same_as", path, line),
            implied_by=_text(doc, "implied_by", path, line),
            unreadable=bool(doc.get("unreadable", False)),
            shape=dims,
            reset_kept=doc.get("reset_kept") is True,
            shards=validate.shards(doc.get("shard_fp"), count, dims, tp, where, name),
        )
    except KeyError as exc:
        raise _bad(path, line, f"key {exc.args[0]!r} missing") from None


def _one_hash_kind(kinds: dict[str, str], folder: Path) -> None:
    if len(kinds) > 1:
        (a, where_a), (b, where_b) = sorted(kinds.items())[:2]
        raise UserError(
            f"{folder}: hashes of two kinds, {a} ({where_a}) and {b} ({where_b}): the trees were patched by "
            "different rl-msprobe versions; re-apply the patch sets prepare prints with this rl-msprobe "
            "(patch revert, then patch apply) and rerun the job."
        )


def read_run(folder: Path) -> Run:
    """Read every `*.jsonl` under FOLDER (not recursive); UserError when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder; pass the weights folder of a run (<dump-dir>/weights).")
    paths = sorted(p for p in folder.glob("*.jsonl") if p.name.split("-", 1)[0] in (*STAGES,))
    if not paths:
        raise UserError(
            f"{folder}: no sent-/received-/resident-*.jsonl files; run the job with the verl-weights patch set "
            "applied and RL_MSPROBE_WEIGHTS_DIR set to this folder (rl-msprobe prepare SCRIPT --mode weights)."
        )
    run = Run(folder)
    kinds: dict[str, str] = {}  # hash kind -> the first line that has it
    consistency = validate.Consistency()
    for path in paths:
        process = path.stem.split("-", 1)[1] if "-" in path.stem else path.stem
        run.files += 1
        with bounded.open_regular(path, WHAT) as fh:
            for number, raw in enumerate(bounded.lines(fh, path, WHAT, LINE_LIMIT), 1):
                if not raw.strip():
                    continue
                try:
                    doc = json.loads(raw)
                except ValueError as exc:
                    raise _bad(path, number, f"not JSON ({str(getattr(exc, 'msg', exc))[:80]})") from None
                except RecursionError:
                    raise _bad(path, number, "JSON nested too deeply") from None
                if not isinstance(doc, dict):
                    raise _bad(path, number, "not a JSON object")
                if doc.get("stage") == META:
                    _check_meta(doc, path, number)
                    metas = run.meta[_whole(doc, "sync", path, number, SYNC_LIMIT, default=0)]
                    metas[process] = _merged(metas.get(process), doc)
                    continue
                if doc.get("stage") not in STAGES:
                    raise _bad(path, number, f"stage {doc.get('stage')!r} is not one of {', '.join(STAGES)}")
                entry = _entry(doc, path, number, process)
                consistency.check(entry.stage, entry.name, entry.dtype, entry.shape, path, number)
                if entry.hash:
                    kinds.setdefault(hash_kind(entry.hash), f"{path.name}:{number}")
                run.entries[entry.stage][entry.sync].setdefault(process, {})[entry.name] = entry
    _one_hash_kind(kinds, folder)
    return run


def _merged(old: JsonObject | None, doc: JsonObject) -> JsonObject:
    """One process's meta lines of one sync as one: the later line's keys win, name lists add up
    (`unwritten` at the sync's end, `reset_kept` at the next sync's start)."""
    if old is None:
        return doc
    out = {**old, **doc}
    for key in ("unwritten", "reset_kept"):
        names = [*(old.get(key) or []), *(doc.get(key) or [])]
        if names:
            out[key] = names
    return out

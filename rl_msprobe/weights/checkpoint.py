"""The checkpoint on disk against what the engine holds (`weights compare DIR --checkpoint CKPT`).

The checkpoint's tensors (Hugging Face safetensors: `model.safetensors` or the shards an
`*.index.json` names) are fingerprinted here, in blocks read from the file, and each is held
against the engine's resident fingerprints of one sync (the first by default: the weights it
serves before any update), through the same layout knowledge as the sync's compare: fused
q|k|v and gate|up split back into HF names, TP shards and replicas combined, vocabulary padding
dropped, tied names accounted for, a dtype cast allowed one rounding. The first differing tensor
is named with how it differs (the statistics' `what`: values, a cast beyond one rounding, ...).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rl_msprobe import bounded
from rl_msprobe.errors import UserError
from rl_msprobe.weights.compare import (
    DIFFERENT,
    EQUAL,
    NOT_COMPARED,
    Finding,
    replicas_by_rank,
    resident_finding,
    sync_meta,
)
from rl_msprobe.weights.experts import expert_of, expert_text
from rl_msprobe.weights.fingerprint import Fingerprint, delta_text
from rl_msprobe.weights.records import Entry, Run

DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# floating kinds a checkpoint may hold that are not fingerprinted here: NOT COMPARED, never "missing"
UNREAD_FLOATS = ("F8_", "F6_", "F4", "C64")
BLOCK = 1 << 20  # elements per block: a bounded read of a tensor of any size
HEADER_LIMIT = 100 << 20  # the safetensors library's own limit on a header
FIX = "download or save the checkpoint again (or pass the folder of a complete one)"


class Tensors(dict[str, Entry]):
    """The checkpoint's fingerprinted tensors by name, and those of a floating dtype not fingerprinted
    here (`unread`: name -> why), so they are NOT COMPARED rather than missing."""

    def __init__(self) -> None:
        super().__init__()
        self.unread: dict[str, str] = {}


def files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those an index names, else every *.safetensors. Each is a
    readable regular file (a FIFO, a device, a folder or a missing shard is refused naming it)."""
    if not folder.is_dir():
        raise UserError(f"{folder}: not a directory. Pass the model folder (config.json, *.safetensors).")
    try:
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        found = sorted(folder.glob("*.safetensors"))
    except OSError as exc:
        raise UserError(
            f"{folder}: cannot be listed ({exc.strerror}); make it readable and run again."
        ) from None
    if indexes:
        index = indexes[0]
        text = bounded.read_text(index, "safetensors index (*.safetensors.index.json)", bounded.CONFIG)
        try:
            weight_map = json.loads(text)["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise UserError(
                f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); {FIX}."
            ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f'{index}: "weight_map" must map tensor names to shard file names; {FIX}.')
        names = sorted(set(weight_map.values()))
        for name in names:
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise UserError(f"{index}: names the shard {name!r}, not a file name in {folder}; {FIX}.")
            if not (folder / name).exists():
                raise UserError(f"{index}: names the shard {name}, which {folder} lacks; {FIX}.")
        found = [folder / name for name in names]
    if not found:
        raise UserError(f"{folder}: no *.safetensors file (only the safetensors layout is read).")
    for path in found:
        bounded.regular(path, "safetensors shard")
    return found


def _header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets) and where their data
    starts, once the safetensors library has checked the file: its header, every tensor's offsets
    against its shape and dtype, and the file's length."""
    from safetensors import SafetensorError, safe_open

    bounded.regular(path, "safetensors shard")  # never mapped or opened when a FIFO or a device
    try:
        with safe_open(path, framework="numpy"):
            pass
    except SafetensorError as exc:
        raise UserError(f"{path}: not a valid safetensors file ({_why(path, exc)}); {FIX}.") from None
    except OSError as exc:
        raise UserError(
            f"{path}: cannot be read ({exc.strerror}); pass a readable safetensors shard."
        ) from None
    with bounded.open_regular(path, "safetensors shard") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))  # checked by the library: 8 bytes, at most its limit
        header = json.loads(fh.read(min(size, HEADER_LIMIT)))
    return {k: v for k, v in header.items() if k != "__metadata__"}, 8 + size


def _why(path: Path, exc: Exception) -> str:
    """The library's reason, with the first tensor whose offsets disagree with its shape and dtype
    named when the header shows one."""
    why = str(exc).removeprefix("Error while deserializing header: ")
    try:
        with bounded.open_regular(path, "safetensors shard") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(min(size, HEADER_LIMIT)))
        widths = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
        for name, info in header.items():
            if name == "__metadata__" or info.get("dtype") not in widths:
                continue
            start, end = info["data_offsets"]
            want = math.prod(info["shape"]) * widths[info["dtype"]]
            if end - start != want:
                return f"{why}: tensor {name} has offsets {start}..{end} ({end - start} bytes), its shape {info['shape']} and dtype {info['dtype']} need {want}"
    except Exception:  # the library's reason stands alone
        pass
    return why


def _blocks(path: Path, start: int, count: int, dtype: str) -> Iterator[Any]:
    """The tensor's elements as float64 numpy blocks (bf16 widened through its bits)."""
    import numpy as np

    width = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    with bounded.open_regular(path, "safetensors shard") as fh:
        fh.seek(start)
        left = count
        while left:
            n = min(left, BLOCK)
            try:
                raw = fh.read(n * width)
            except OSError as exc:
                raise UserError(
                    f"{path}: cannot be read ({exc.strerror}); pass a readable safetensors shard."
                ) from None
            if len(raw) != n * width:
                raise UserError(f"{path}: cut short inside a tensor (changed while read?); {FIX}.")
            if dtype == "bfloat16":
                bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
                yield bits.view(np.float32).astype(np.float64)
            else:
                yield np.frombuffer(raw, dtype=np.dtype(dtype)).astype(np.float64)
            left -= n


def fingerprint(path: Path, start: int, count: int, dtype: str) -> Fingerprint:
    """{count, sum, sumsq, min, max, nan, inf} as the job-side helper takes it (finite elements only)."""
    import numpy as np

    total = sumsq = 0.0
    low = high = None
    nan = inf = 0
    for a in _blocks(path, start, count, dtype):
        bad_nan, bad_inf = np.isnan(a), np.isinf(a)
        nan, inf = nan + int(bad_nan.sum()), inf + int(bad_inf.sum())
        a = a[~(bad_nan | bad_inf)]
        total += float(a.sum())
        sumsq += float(np.dot(a, a))
        if a.size:
            low = float(a.min()) if low is None else min(low, float(a.min()))
            high = float(a.max()) if high is None else max(high, float(a.max()))
    return Fingerprint(count, total, sumsq, low, high, nan, inf)


def read_checkpoint(folder: Path) -> Tensors:
    """Every floating tensor of the checkpoint as a reference entry (stage `checkpoint`); those of a
    dtype not fingerprinted here (8-bit floats, ...) in `.unread`."""
    out = Tensors()
    for path in files(folder):
        header, base = _header(path)
        for name, info in header.items():
            code = str(info["dtype"])
            dtype = DTYPES.get(code)
            if dtype is None:
                if code.startswith(UNREAD_FLOATS):
                    out.unread[name] = f"dtype {code} in {path.name}: rl-msprobe does not fingerprint it"
                continue  # integer buffers and booleans: no weight the sync carries
            shape = [int(x) for x in info["shape"]]
            start = base + int(info["data_offsets"][0])
            fp = fingerprint(path, start, math.prod(shape), dtype)
            out[name] = Entry("checkpoint", 0, 0, path.name, name, len(out), dtype, fp, shape=tuple(shape))
    if not out and not out.unread:
        raise UserError(f"{folder}: no floating tensor in its safetensors files.")
    return out


def compare_checkpoint(run: Run, checkpoint: dict[str, Entry], sync: int | None = None) -> dict[str, Any]:
    """The checkpoint's tensors against the engine's resident ones at SYNC (default: the first)."""
    syncs = sorted(run.entries["resident"])
    if not syncs:
        raise UserError(
            f"{run.folder}: no resident fingerprints; the engine side wrote nothing to compare with."
        )
    at = syncs[0] if sync is None else sync
    if at not in run.entries["resident"]:
        raise UserError(
            f"--sync {at}: the engine wrote resident fingerprints at syncs {syncs[0]}..{syncs[-1]}."
        )
    replicas = replicas_by_rank(run.entries["resident"][at]) or [{}]
    aliases, tp, _ = sync_meta(run, at)
    resident = replicas[0]
    held = {n for e in resident.values() for n in e}
    rows: list[dict[str, Any]] = []
    first = None
    for name, entry in checkpoint.items():
        finding: Finding
        finding, _, how = resident_finding(entry, resident, name, aliases, None, tp)
        row: dict[str, Any] = {
            "name": name,
            "dtype": entry.dtype,
            "shape": list(entry.shape or ()),
            **finding.to_dict(),
        }
        if how:
            row["how"] = how
        expert = expert_of(name)
        if expert is not None:
            row["expert"] = expert
        rows.append(row)
        if first is None and finding.status == "differs":
            first = row
    unread = getattr(checkpoint, "unread", {})
    for name in sorted(unread):
        rows.append({"name": name, "status": "not-compared", "why": unread[name]})
    for name in sorted(held - set(checkpoint) - set(unread) - set(aliases)):
        rows.append({"name": name, "status": "missing", "why": "held by the engine, not in the checkpoint"})
    statuses = [str(r["status"]) for r in rows]
    if "differs" in statuses:
        verdict = DIFFERENT
    elif any(s not in ("equal", "tied") for s in statuses):
        verdict = NOT_COMPARED
    else:
        verdict = EQUAL
    return {
        "verdict": verdict,
        "sync": at,
        "checkpoint_tensors": len(checkpoint),
        "counts": {s: statuses.count(s) for s in sorted(set(statuses))},
        "first_difference": first,
        "tensors": rows,
    }


def summary_lines(doc: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {s}" for s, n in doc["counts"].items())
    lines = [
        f"checkpoint against the engine at sync {doc['sync']}: {doc['checkpoint_tensors']} tensors; {counts}"
    ]
    for row in doc["tensors"]:
        if row["status"] not in ("equal", "tied"):
            detail = ", ".join(
                f"{k} {v}" for k, v in row.items() if k not in ("name", "status", "expert") and v is not None
            )  # None: not measured or infinite, as in the sync report's findings
            lines.append(f"  {row['status']}: {row['name']}{expert_text(row['name'])} ({detail})")
    first = doc["first_difference"]
    if isinstance(first, dict):
        lines.append(f"first difference: {first['name']}{expert_text(first['name'])}: {delta_text(first)}")
    lines.append(str(doc["verdict"]))
    return lines

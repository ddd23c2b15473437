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
BLOCK = 1 << 20  # elements per block: a bounded read of a tensor of any size
HEADER_LIMIT = 100 << 20


def files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those an index names, else every *.safetensors."""
    if not folder.is_dir():
        raise UserError(f"{folder}: not a directory. Pass the model folder (config.json, *.safetensors).")
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{indexes[0]}: not a safetensors index ({exc}).") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise UserError(f"{folder}: no *.safetensors file (only the safetensors layout is read).")
    return found


def _header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise UserError(f"{path}: too short for a safetensors file.")
        (size,) = struct.unpack("<Q", raw)
        if size > HEADER_LIMIT:
            raise UserError(f"{path}: a safetensors header of {size} bytes; not a safetensors file?")
        try:
            header = json.loads(fh.read(size))
        except ValueError as exc:
            raise UserError(f"{path}: the safetensors header is not JSON ({exc}).") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is not an object.")
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}, 8 + size


def _blocks(path: Path, start: int, count: int, dtype: str) -> Iterator[Any]:
    """The tensor's elements as float64 numpy blocks (bf16 widened through its bits)."""
    import numpy as np

    width = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    with path.open("rb") as fh:
        fh.seek(start)
        left = count
        while left:
            n = min(left, BLOCK)
            raw = fh.read(n * width)
            if len(raw) != n * width:
                raise UserError(f"{path}: cut short inside a tensor; the file is incomplete.")
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


def read_checkpoint(folder: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint as a reference entry (stage `checkpoint`)."""
    out: dict[str, Entry] = {}
    for path in files(folder):
        header, base = _header(path)
        for name, info in header.items():
            dtype = DTYPES.get(str(info.get("dtype")))
            shape = info.get("shape")
            offsets = info.get("data_offsets")
            if (
                dtype is None
                or not isinstance(shape, list)
                or not isinstance(offsets, list)
                or len(offsets) != 2
            ):
                continue  # integer buffers and other kinds: no weight the sync carries
            count = math.prod(int(x) for x in shape)
            fp = fingerprint(path, base + int(offsets[0]), count, dtype)
            out[name] = Entry("checkpoint", 0, 0, path.name, name, len(out), dtype, fp, shape=tuple(shape))
    if not out:
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
    for name in sorted(held - set(checkpoint) - set(aliases)):
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

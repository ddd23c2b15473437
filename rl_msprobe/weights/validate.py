"""Checks on the numbers of a weights fingerprint line, where it is read (records.py).

The job-side helper writes its statistics with `json.dumps(..., allow_nan=False)` over the finite
elements only (NaN and Inf elements are counted in `nan` / `inf`): a NaN, an Infinity or a
`1e400` (read as inf) in `sum`, `sumsq`, `min` or `max` is a line it never wrote. So are a
negative count or sum of squares, more NaN/Inf than elements, min above max, statistics no real
tensor has (|sum| above sqrt(n * sumsq), an extreme beyond the norm), and a shape whose elements
are not the count. Across lines, the same tensor keeps its shape between `sent` and `received` and
over the syncs, and its dtype over the ranks of a stage and over the syncs. Any of these is bad
input: UserError naming the file, line, tensor, key and value, never a verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_msprobe.errors import UserError
from rl_msprobe.weights.fingerprint import Fingerprint

COUNT_LIMIT = 1 << 53  # elements of one tensor: float64 counts them exactly up to here
DIMS_LIMIT = 64  # torch allows 64 dimensions
FIX = "the files are written by the verl-weights patch set; rerun the job rather than editing them"
# float64 sums of the same elements in another order agree far better than this, relatively
_SLACK = 1e-6


def _shown(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # nan / inf (json.dumps would write NaN / Infinity, or refuse)
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _bad(where: str, name: str, what: str) -> UserError:
    return UserError(f"{where}: tensor {name!r}: {what}; {FIX}.")


def _whole(doc: Mapping[str, Any], key: str, where: str, name: str, label: str, required: bool) -> int:
    value = doc.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, name, f"{label}.{key} is {_shown(value)}, not a whole number")
    if not 0 <= value <= COUNT_LIMIT:
        raise _bad(where, name, f"{label}.{key} is {_shown(value)}, outside 0..2**53")
    return value


def _real(
    doc: Mapping[str, Any], key: str, where: str, name: str, label: str, required: bool
) -> float | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, name, f"{label}.{key} is {_shown(value)}, not a number")
    number = float(value) if not isinstance(value, int) or abs(value) < 1 << 1000 else math.inf
    if not math.isfinite(number):
        raise _bad(
            where,
            name,
            f"{label}.{key} is {_shown(value)}, not a finite number (the helper sums the finite elements "
            "only and counts NaN / Inf in nan / inf)",
        )
    return number


def fingerprint(doc: object, where: str, name: str, label: str = "fp") -> Fingerprint:
    """The Fingerprint of a line's `fp` (or a `shard_fp` entry), every number checked."""
    if not isinstance(doc, dict):
        raise _bad(where, name, f"{label} is {_shown(doc)}, not an object of statistics")
    count = _whole(doc, "count", where, name, label, True)
    nan = _whole(doc, "nan", where, name, label, False)
    inf = _whole(doc, "inf", where, name, label, False)
    total = _real(doc, "sum", where, name, label, True)
    sumsq = _real(doc, "sumsq", where, name, label, True)
    low = _real(doc, "min", where, name, label, False)
    high = _real(doc, "max", where, name, label, False)
    assert total is not None and sumsq is not None
    finite = count - nan - inf
    if finite < 0:
        raise _bad(where, name, f"{label} counts {nan} NaN and {inf} Inf in {count} elements")
    if sumsq < 0:
        raise _bad(where, name, f"{label}.sumsq is {_shown(doc['sumsq'])}, negative (a sum of squares)")
    if (low is None) != (high is None) or (low is None) != (finite == 0):
        raise _bad(
            where, name, f"{label}.min / max are {_shown(doc.get('min'))} / {_shown(doc.get('max'))} for "
            f"{finite} finite element(s)"
        )  # fmt: skip
    norm = math.sqrt(sumsq)
    if low is not None and high is not None:
        if low > high:
            raise _bad(where, name, f"{label}.min {_shown(low)} is above max {_shown(high)}")
        if max(abs(low), abs(high)) > norm * (1 + _SLACK) + 1e-150:
            raise _bad(
                where, name, f"{label}: |min| or |max| exceeds sqrt(sumsq) = {norm:.6g}: no tensor has that"
            )
    if abs(total) > math.sqrt(finite) * norm * (1 + _SLACK) + 1e-150:
        raise _bad(
            where, name, f"{label}.sum {_shown(total)} exceeds sqrt(n * sumsq) = {math.sqrt(finite) * norm:.6g}: "
            "no tensor has that"
        )  # fmt: skip
    return Fingerprint(count, total, sumsq, low, high, nan, inf)


def shape(value: object, count: int, where: str, name: str) -> tuple[int, ...] | None:
    """A line's `shape` (None where it is absent), checked against the element count."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > DIMS_LIMIT
        or not all(type(n) is int and 0 <= n <= COUNT_LIMIT for n in value)
    ):
        raise _bad(where, name, f"shape is {_shown(value)}, not a list of sizes")
    elements = math.prod(value)
    if elements != count:
        raise _bad(where, name, f"shape {_shown(value)} holds {elements} elements, but fp.count is {count}")
    return tuple(value)


def dtype(value: object, where: str, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 64:
        raise _bad(where, name, f"dtype is {_shown(value)}, not a dtype name")
    return value


def statistics(doc: Mapping[str, Any], where: str, name: str) -> tuple[Fingerprint | None, int]:
    """A line's `fp` and its element count. `"fp": null` is a line whose statistics the helper left
    out (lazy statistics: only its checksum taken), valid only with a hash and a shape to count by."""
    value = doc["fp"]
    if value is not None:
        fp = fingerprint(value, where, name)
        return fp, fp.count
    if not isinstance(doc.get("hash"), str) or not doc.get("hash"):
        raise _bad(where, name, "fp is null without a hash: a line with neither statistics nor checksum")
    dims = doc.get("shape")
    if not isinstance(dims, list):
        raise _bad(where, name, f"fp is null and shape is {_shown(dims)}: nothing to count the elements by")
    count = math.prod(n for n in dims if type(n) is int and n >= 0) if len(dims) <= DIMS_LIMIT else -1
    return None, count


def shards(
    value: object, count: int, dims: tuple[int, ...] | None, tp: int | None, where: str, name: str
) -> dict[int, Fingerprint]:
    """A received line's `shard_fp` (this rank's 1/TP chunk along dim 0 / 1): dims of the tensor,
    each chunk 1/TP of its elements where the TP size is given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(where, name, f"shard_fp is {_shown(value)}, not an object of fingerprints by dim")
    out: dict[int, Fingerprint] = {}
    for key, fp in value.items():
        if key not in ("0", "1") or (dims is not None and int(key) >= len(dims)):
            raise _bad(
                where, name, f"shard_fp has dim {_shown(key)}, not a dim (0 or 1) of shape {_shown(dims)}"
            )
        part = fingerprint(fp, where, name, f"shard_fp.{key}")
        if tp and part.count * tp != count:
            raise _bad(
                where, name, f"shard_fp.{key}.count is {part.count}, not 1/{tp} of the tensor's {count}"
            )  # fmt: skip
        out[int(key)] = part
    return out


@dataclass(frozen=True)
class _Seen:
    dtype: str
    shape: tuple[int, ...] | None
    where: str


class Consistency:
    """What each tensor looked like where it was first read, to refuse a line that disagrees:
    the same shape in `sent` and `received` (one layout, each rank gets the whole tensor) and over
    the syncs; the same dtype over the ranks of one stage and over the syncs. Resident parts are TP
    shards, repacked or padded layouts: their shape is only held to their own count."""

    def __init__(self) -> None:
        self._layout: dict[str, _Seen] = {}  # name -> sent / received layout
        self._dtypes: dict[tuple[str, str], _Seen] = {}  # (stage, name) -> dtype

    def check(
        self, stage: str, name: str, dtype: str, dims: tuple[int, ...] | None, path: Path, line: int
    ) -> None:
        where = f"{path}:{line}"
        here = _Seen(dtype, dims, f"{path.name}:{line}")
        seen = self._dtypes.setdefault((stage, name), here)
        if dtype and seen.dtype and dtype != seen.dtype:
            raise _bad(
                where, name, f"dtype {dtype!r} at stage {stage}, but {seen.dtype!r} at {seen.where}: one tensor "
                "has one dtype on every rank and in every sync"
            )  # fmt: skip
        if stage == "resident" or dims is None:
            return
        first = self._layout.setdefault(name, here)
        if first.shape is not None and dims != first.shape:
            raise _bad(
                where, name, f"shape {list(dims)} at stage {stage}, but {list(first.shape)} at {first.where}: "
                "what is sent is received whole, in every sync"
            )  # fmt: skip
        if first.shape is None:
            self._layout[name] = here

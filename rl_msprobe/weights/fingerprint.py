"""Fingerprints and their combine rules: pure functions over {count, sum, sumsq, min, max, nan, inf}.

The statistics are float64 sums, so they add over concatenation (fused q|k|v, gate|up) and over
TP shards, and ignore permutations (repacked layouts). What breaks additivity is handled here
and nowhere else: elements held by several ranks (replicated norms, KV heads replicated when
TP > KV heads) are divided out by their replica count; vocabulary padding and tied weights are
dealt with where the fingerprint is taken (the padded rows are never fingerprinted) and by name
(`compare`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rl_msprobe.weights.document import DeltaDoc

# unit roundoff of each dtype a weight can have: what one rounding to it may change, relatively
UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "float8_e4m3fn": 2.0**-4,
    "float8_e4m3fnuz": 2.0**-4,
    "float8_e5m2": 2.0**-3,
    "float8_e5m2fnuz": 2.0**-3,
}
ACCUMULATION = 1e-10  # float64 sums of up to ~1e8 elements in different orders agree to this, relatively


@dataclass(frozen=True)
class Fingerprint:
    count: int
    sum: float
    sumsq: float
    min: float | None
    max: float | None
    nan: int = 0
    inf: int = 0

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Fingerprint:
        """From a parsed line's `fp` (TypeError / ValueError / KeyError where it is not one)."""
        return cls(
            int(doc["count"]),
            float(doc["sum"]),
            float(doc["sumsq"]),
            None if doc.get("min") is None else float(doc["min"]),
            None if doc.get("max") is None else float(doc["max"]),
            int(doc.get("nan", 0)),
            int(doc.get("inf", 0)),
        )

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "sum": self.sum,
            "sumsq": self.sumsq,
            "min": self.min,
            "max": self.max,
            "nan": self.nan,
            "inf": self.inf,
        }

    @property
    def norm(self) -> float:
        return math.sqrt(max(self.sumsq, 0.0))


def _extreme(values: Iterable[float | None], pick: Callable[[list[float]], float]) -> float | None:
    present = [v for v in values if v is not None]
    return pick(present) if present else None


def concat(parts: Iterable[Fingerprint]) -> Fingerprint:
    """The fingerprint of the concatenation of PARTS (fused tensors, TP shards, any order)."""
    parts = list(parts)
    return Fingerprint(
        sum(p.count for p in parts),
        math.fsum(p.sum for p in parts),
        math.fsum(p.sumsq for p in parts),
        _extreme((p.min for p in parts), min),
        _extreme((p.max for p in parts), max),
        sum(p.nan for p in parts),
        sum(p.inf for p in parts),
    )


def deduplicate(total: Fingerprint, replicas: int) -> Fingerprint:
    """TOTAL counted every element REPLICAS times (replicated norms, KV heads held by several
    ranks): the fingerprint of the elements once. min / max are unchanged by replication."""
    if replicas < 1 or total.count % replicas or total.nan % replicas or total.inf % replicas:
        raise ValueError(f"{total.count} elements cannot hold each element exactly {replicas} times")
    return Fingerprint(
        total.count // replicas,
        total.sum / replicas,
        total.sumsq / replicas,
        total.min,
        total.max,
        total.nan // replicas,
        total.inf // replicas,
    )


def combine_ranks(shards: Iterable[Fingerprint], whole_count: int) -> tuple[Fingerprint, int]:
    """The whole tensor (WHOLE_COUNT elements) from what each TP rank holds of it, and the replica
    count: each element on exactly r ranks (r = held / whole; 1: sharded, TP size: replicated).
    ValueError when the ranks hold no whole number of copies (a shard missing or extra)."""
    total = concat(shards)
    if whole_count <= 0 or total.count % whole_count:
        raise ValueError(
            f"the ranks hold {total.count} elements, not a whole number of copies of {whole_count}"
        )
    replicas = total.count // whole_count
    return deduplicate(total, replicas), replicas


def unit_roundoff(dtype: str | None) -> float:
    return UNIT_ROUNDOFF.get((dtype or "").removeprefix("torch."), 2.0**-8)


@dataclass(frozen=True)
class Delta:
    """How far GOT is from REF, in units of what the dtypes allow (`ratio` > 1: differs)."""

    equal: bool
    ratio: float  # the largest |difference| / tolerance over the statistics (inf: count or nan/inf differ)
    norm_rel: float  # |‖got‖ - ‖ref‖| / ‖ref‖
    what: str  # the statistic that differs most, in words

    def to_dict(self) -> DeltaDoc:
        return {"ratio": _finite(self.ratio), "norm_rel": _finite(self.norm_rel), "what": self.what}


def delta_text(detail: Mapping[str, Any]) -> str:
    """`norm rel 0.0013, sum, 4.2x tolerance` from a finding's keys, leaving out what says nothing:
    a norm or ratio that is None (infinite, or statistics not taken on one side) and the tolerance
    ratio of a bit-level finding (its statistics agree or were never taken)."""
    parts = []
    if detail.get("norm_rel") is not None:
        parts.append(f"norm rel {detail['norm_rel']:.3g}")
    what = detail.get("what")
    if what:
        parts.append(str(what))
    if detail.get("ratio") is not None and not str(what or "").startswith("bits"):
        parts.append(f"{detail['ratio']:.3g}x tolerance")
    return ", ".join(parts)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def compare(ref: Fingerprint, got: Fingerprint, roundoff: float = 0.0) -> Delta:
    """Are REF and GOT the same tensor up to ROUNDOFF (the unit roundoff of a dtype conversion
    between them; 0 for the same dtype), plus float64 accumulation order?

    Bounds for x -> x(1+d), |d| <= u: |Δsum| <= u Σ|x| <= u sqrt(n Σx²); |Δsumsq| <= (2u + u²) Σx²;
    |Δmin|, |Δmax| <= u |x|.
    """
    norm_rel = abs(got.norm - ref.norm) / ref.norm if ref.norm else (0.0 if got.norm == 0 else math.inf)
    if got.count != ref.count:
        return Delta(False, math.inf, norm_rel, f"{got.count} elements, not {ref.count}")
    if (got.nan, got.inf) != (ref.nan, ref.inf):
        return Delta(False, math.inf, norm_rel, f"NaN/Inf {got.nan}/{got.inf}, not {ref.nan}/{ref.inf}")
    u = roundoff + ACCUMULATION
    scale = math.sqrt(ref.count * ref.sumsq)
    checks = [
        ("sum", abs(got.sum - ref.sum), u * scale),
        ("sum of squares", abs(got.sumsq - ref.sumsq), (2 * u + u * u) * ref.sumsq),
    ]
    for label, a, b in (("min", ref.min, got.min), ("max", ref.max, got.max)):
        if (a is None) != (b is None):
            return Delta(False, math.inf, norm_rel, f"{label} missing on one side")
        if a is not None and b is not None:
            checks.append((label, abs(b - a), u * abs(a)))
    worst, ratio = "none", 0.0
    for label, diff, tol in checks:
        r = diff / tol if tol > 0 else (0.0 if diff == 0 else math.inf)
        if r > ratio:
            worst, ratio = label, r
    return Delta(ratio <= 1.0, ratio, norm_rel, worst)

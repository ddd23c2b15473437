"""The distribution at every response position: rollout top-k against the training engine's.

A triage line of schema ``rl-msprobe-triage/2`` may carry a ``distribution`` object (written by
the patched trainer when ``prepare --mode triage --top-k K`` asked for it): per response
position the rollout's top-k token ids and log-probs (as the engine returned them), the
training engine's log-probs of those same ids (from its full-vocabulary log-softmax), its own
top-k ids and log-probs, its logsumexp and its entropy. No logits are stored.

From these, per position (pure functions over arrays, no I/O):

- ``kl_topk``: Σ_top-k p_r log(p_r / p_t) over the rollout's top-k ids, and ``kl_low`` =
  kl_topk + a_r log(a_r / a_t), with a_r, a_t the two sides' mass outside those ids (the tail):
  by the log-sum inequality ``kl_low`` ≤ KL(rollout ‖ train) whatever the tail holds, and it
  is the KL of the distribution coarse-grained to the k ids plus one "other" token;
- ``tv_low`` / ``tv_high``: total variation is ½Σ|p_r − p_t| over the k ids plus ½Σ over the
  tail, which lies between ½|a_r − a_t| and ½(a_r + a_t);
- ``overlap``: the share of the rollout's top-k ids among the training engine's top-k;
- ``top1``: both sides' most likely token is the same id;
- ``entropy_gap``: the rollout's entropy minus the training engine's, both restricted to the
  rollout's top-k ids (the one support both sides have).

A rollout log-prob of −inf (null in the line: a token the engine masked out, e.g. outside its
top-p nucleus when it returns processed log-probs) counts as probability 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("kl_topk", "kl_low", "tv_low", "tv_high", "overlap", "top1", "entropy_gap")
ARRAYS = ("rollout_ids", "rollout", "train_at_rollout", "train_ids", "train")


class BadDistribution(ValueError):
    """A line's ``distribution`` object that is not what the helper writes (the reason says which key)."""


@dataclass
class Request:
    """One request's distribution arrays, [positions, k] (nan: no value; -inf: masked out)."""

    rollout_ids: Any  # int64 [n, k], -1 where the engine returned fewer
    rollout: Any  # float64 [n, k]
    train_at_rollout: Any  # float64 [n, k]
    train_ids: Any  # int64 [n, k]
    train: Any  # float64 [n, k]
    lse: Any = None  # float64 [n]
    entropy: Any = None  # float64 [n]

    @property
    def positions(self) -> int:
        return int(self.rollout.shape[0])


def _matrix(value: Any, key: str, dtype: Any, fill: float) -> Any:
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise BadDistribution(f"distribution.{key} is not a list of lists")
    width = max((len(row) for row in value), default=0)
    out = np.full((len(value), width), fill, dtype=np.float64)
    for i, row in enumerate(value):
        for j, v in enumerate(row):
            if v is None:
                out[i, j] = -math.inf if key == "rollout" else math.nan
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[i, j] = v
            else:
                raise BadDistribution(f"distribution.{key}[{i}][{j}] is {v!r}, not a number")
    if dtype is np.int64:
        ids = np.where(np.isfinite(out), out, -1).astype(np.int64)
        return ids
    return out


def parse(doc: Any) -> Request:
    """A line's ``distribution`` object -> Request (BadDistribution names the key that is wrong)."""
    if not isinstance(doc, dict):
        raise BadDistribution("distribution is not an object")
    for key in ARRAYS:
        if key not in doc:
            raise BadDistribution(f"distribution has no {key!r}")
    rids = _matrix(doc["rollout_ids"], "rollout_ids", np.int64, math.nan)
    r = _matrix(doc["rollout"], "rollout", np.float64, math.nan)
    tr = _matrix(doc["train_at_rollout"], "train_at_rollout", np.float64, math.nan)
    tids = _matrix(doc["train_ids"], "train_ids", np.int64, math.nan)
    t = _matrix(doc["train"], "train", np.float64, math.nan)
    n = min(len(rids), len(r), len(tr), len(tids), len(t))
    if rids.shape[1:] != r.shape[1:] or r.shape[1:] != tr.shape[1:]:
        raise BadDistribution("distribution.rollout_ids, rollout and train_at_rollout differ in width")
    vectors = []
    for key in ("lse", "entropy"):
        v = doc.get(key)
        vectors.append(
            None if v is None else np.asarray([math.nan if x is None else x for x in v], float)[:n]
        )
    return Request(rids[:n], r[:n], tr[:n], tids[:n], t[:n], *vectors)


def position_metrics(req: Request) -> dict[str, Any]:
    """Per position of one request: the METRICS (float64 [n]; nan where a position has no top-k)."""
    lr, lt = req.rollout, req.train_at_rollout
    valid = (req.rollout_ids >= 0) & ~np.isnan(lr) & ~np.isnan(lt)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        pr = np.where(valid, np.exp(np.where(valid, lr, -np.inf)), 0.0)
        pt = np.where(valid, np.exp(np.where(valid, lt, -np.inf)), 0.0)
        mass_r, mass_t = pr.sum(axis=1), pt.sum(axis=1)
        tail_r = np.clip(1.0 - mass_r, 0.0, 1.0)
        tail_t = np.clip(1.0 - mass_t, 0.0, 1.0)
        terms = np.where(pr > 0, pr * (np.where(pr > 0, lr, 0.0) - np.where(pr > 0, lt, 0.0)), 0.0)
        kl_topk = terms.sum(axis=1)
        tail = np.where(tail_r > 0, tail_r * (np.log(tail_r) - np.log(np.maximum(tail_t, 1e-300))), 0.0)
        kl_low = np.maximum(kl_topk + tail, 0.0)
        half = 0.5 * np.abs(pr - pt).sum(axis=1)
        tv_low = half + 0.5 * np.abs(tail_r - tail_t)
        tv_high = np.minimum(half + 0.5 * (tail_r + tail_t), 1.0)
        h_r = -np.where(pr > 0, pr * np.where(pr > 0, lr, 0.0), 0.0).sum(axis=1)
        h_t = -np.where(pt > 0, pt * np.where(pt > 0, lt, 0.0), 0.0).sum(axis=1)
    # rollout's first id with a finite log-prob vs the training engine's first id
    has = valid.any(axis=1) & (req.train_ids.shape[1] > 0)
    r_first = np.where(valid.any(axis=1), req.rollout_ids[np.arange(len(lr)), np.argmax(valid, axis=1)], -1)
    t_first = req.train_ids[:, 0] if req.train_ids.shape[1] else np.full(len(lr), -2)
    top1 = (r_first == t_first).astype(float)
    overlap = np.zeros(len(lr))
    for i in range(len(lr)):
        ids = set(req.rollout_ids[i][valid[i] & (lr[i] > -np.inf)].tolist())
        if ids:
            overlap[i] = len(ids & set(req.train_ids[i].tolist())) / len(ids)
    out = {
        "kl_topk": kl_topk,
        "kl_low": kl_low,
        "tv_low": tv_low,
        "tv_high": tv_high,
        "overlap": overlap,
        "top1": top1,
        "entropy_gap": h_r - h_t,
    }
    for key in out:
        out[key] = np.where(has, out[key], np.nan)
    return out


@dataclass
class Sums:
    """Running sums of the METRICS, per response position (grown as needed) and in all."""

    sums: dict[str, Any] = field(default_factory=dict)  # metric -> float64 [positions]
    counts: Any = None  # int64 [positions]
    peak_kl: float = 0.0
    requests: int = 0

    def add(self, metrics: dict[str, Any]) -> None:
        n = len(metrics["kl_low"])
        have = 0 if self.counts is None else len(self.counts)
        if n > have:
            self.counts = _grow(self.counts, n, np.int64)
            for key in METRICS:
                self.sums[key] = _grow(self.sums.get(key), n, np.float64)
        ok = ~np.isnan(metrics["kl_low"])
        self.counts[:n] += ok
        for key in METRICS:
            self.sums[key][:n] += np.where(ok, metrics[key], 0.0)
        if ok.any():
            self.peak_kl = max(self.peak_kl, float(np.nanmax(metrics["kl_low"])))
        self.requests += 1

    @property
    def positions(self) -> int:
        return int((self.counts > 0).sum()) if self.counts is not None else 0

    def mean(self, key: str) -> float:
        if self.counts is None or not self.counts.sum():
            return math.nan
        return float(self.sums[key].sum() / self.counts.sum())

    def by_position(self, key: str) -> Any:
        if self.counts is None:
            return np.zeros(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.counts > 0, self.sums[key] / np.maximum(self.counts, 1), np.nan)

    def every_position(self, key: str, low: bool) -> float:
        """The smallest (low) or largest per-position mean of KEY over the positions seen."""
        values = self.by_position(key)
        values = values[~np.isnan(values)]
        if not len(values):
            return math.nan
        return float(values.min() if low else values.max())

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens": int(self.counts.sum()) if self.counts is not None else 0,
            **{f"mean_{key}": _finite(self.mean(key)) for key in METRICS},
            "max_kl_low": _finite(self.peak_kl),
            "min_position_top1": _finite(self.every_position("top1", low=True)),
            "max_position_kl_low": _finite(self.every_position("kl_low", low=False)),
        }


def _grow(arr: Any, n: int, dtype: Any) -> Any:
    out = np.zeros(n, dtype)
    if arr is not None:
        out[: len(arr)] = arr
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None

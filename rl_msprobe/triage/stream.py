"""Stream triage lines (`<dir>/<pid>/triage.jsonl`) into bounded per-step, per-position and per-token sums.

Quantities are verl's own (`verl/utils/debug/metrics.py`, 0.9.1): over the response tokens
verl's mask counts, |Δp| = |exp(train log p) − exp(rollout log p)| is what verl logs as
`training/rollout_probs_diff_{mean,max,std}` (token mean over the whole step; std unbiased);
|Δ log p| = |train log p − rollout log p| is the same gap in log space. Mean, max and std are
exact; p99 comes from a histogram of 50 log-spaced bins per decade (within 5%).

Lines are parsed one by one and their arrays gathered into chunks that numpy reduces at once,
so the cost stays close to parsing the lines. Memory holds one chunk, one entry per step, one
per response position and per token id, and the `keep` worst requests: never one per line.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.dumps.layout import walk_files
from rl_msprobe.errors import UserError

LOG_NAME = "triage.jsonl"
CHUNK = 4096  # lines reduced together
BINS_PER_DECADE = 50
LOW_DECADE = -9  # |Δ| below 1e-9 (and exact zeros) fall in bin 0
N_BINS = 1 + BINS_PER_DECADE * 11  # up to 1e2
QUANTITIES = ("dlogp", "dp")  # |Δ log p|, |Δp|


def _np():
    try:
        import numpy
    except ModuleNotFoundError:  # pragma: no cover - numpy is a dependency
        raise UserError("mismatch report needs numpy: pip install numpy") from None
    return numpy


@dataclass
class Gap:
    """Running sums of one quantity over a set of tokens."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    peak: float = 0.0
    hist: Any = None  # numpy int64[N_BINS]

    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def std(self) -> float:  # torch.std: unbiased
        if self.count < 2:
            return math.nan
        var = (self.squares - self.total * self.total / self.count) / (self.count - 1)
        return math.sqrt(max(var, 0.0))

    def quantile(self, q: float) -> float:
        if not self.count or self.hist is None:
            return math.nan
        np = _np()
        cum = np.cumsum(self.hist)
        b = int(np.searchsorted(cum, q * self.count))
        return min(bin_upper(b), self.peak)

    def to_json(self) -> dict[str, float | int]:
        return {
            "tokens": self.count,
            "mean": self.mean(),
            "p99": self.quantile(0.99),
            "max": self.peak if self.count else math.nan,
            "std": self.std(),
        }


def bin_upper(b: int) -> float:
    return 10.0 ** (LOW_DECADE + b / BINS_PER_DECADE)


@dataclass
class StepStats:
    step: Any
    requests: int = 0
    gaps: dict[str, Gap] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "requests": self.requests,
            **{q: g.to_json() for q, g in self.gaps.items()},
        }


@dataclass(order=True)
class Worst:
    """One of the worst requests: ranked by its largest |Δ log p|, then its mean."""

    key: tuple[float, float]
    step: Any = field(compare=False)
    request_id: str | None = field(compare=False)
    uid: str | None = field(compare=False)
    index: int | None = field(compare=False)
    prompt_len: int | None = field(compare=False)
    response_len: int = field(compare=False)
    mean_dlogp: float = field(compare=False)
    mean_dp: float = field(compare=False)
    positions: list[dict[str, Any]] = field(compare=False)  # the worst positions of this request
    where: str = field(compare=False)  # file:line
    prompt_ids: list[int] | None = field(compare=False, default=None)
    sample: dict[str, Any] | None = field(compare=False, default=None)

    def to_json(self, full: bool = False) -> dict[str, Any]:
        doc = {
            "step": self.step,
            "request_id": self.request_id,
            "uid": self.uid,
            "index": self.index,
            "prompt_len": self.prompt_len,
            "response_len": self.response_len,
            "max_dlogp": self.key[0],
            "mean_dlogp": self.mean_dlogp,
            "mean_dp": self.mean_dp,
            "positions": self.positions,
            "where": self.where,
        }
        if full:
            doc["prompt_ids"] = self.prompt_ids
            doc["sample"] = self.sample
        return doc


@dataclass
class Triage:
    files: list[str] = field(default_factory=list)
    lines: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)  # error lines written by the helper (first few)
    error_count: int = 0
    bad_lines: list[str] = field(default_factory=list)  # unparsable lines (first few)
    bad_count: int = 0
    nonfinite: int = 0  # tokens with a non-finite log-prob (left out, as a NaN would poison verl's mean)
    steps: dict[Any, StepStats] = field(default_factory=dict)
    overall: dict[str, Gap] = field(default_factory=dict)
    by_position: dict[str, Any] = field(default_factory=dict)  # q -> (sum, count) numpy arrays
    by_token: dict[str, Any] = field(default_factory=dict)  # q -> (sum, count) numpy arrays
    worst: list[Worst] = field(default_factory=list)  # the worst requests, worst first
    step_worst: dict[Any, Worst] = field(default_factory=dict)  # each step's worst request

    def step_list(self) -> list[StepStats]:
        return [self.steps[k] for k in sorted(self.steps, key=_step_order)]


def _step_order(step: Any) -> tuple[int, Any]:
    return (0, step) if isinstance(step, (int, float)) else (1, str(step))


class _Accumulator:
    """Gathers parsed lines into a chunk; `flush` reduces it into the Triage with numpy."""

    def __init__(self, result: Triage, keep: int) -> None:
        self.np = _np()
        self.result = result
        self.keep = keep
        self.heap: list[Worst] = []
        self._reset()
        for q in QUANTITIES:
            result.overall[q] = Gap(hist=self.np.zeros(N_BINS, self.np.int64))
            result.by_position[q] = (self.np.zeros(0), self.np.zeros(0, self.np.int64))
            result.by_token[q] = (self.np.zeros(0), self.np.zeros(0, self.np.int64))

    def _reset(self) -> None:
        self.rollout: list = []
        self.train: list = []
        self.tokens: list = []
        self.lengths: list[int] = []
        self.line_steps: list[Any] = []
        self.masks: list[tuple[int, list]] = []  # (line number in chunk, mask) for lines with a mask
        self.docs: list[tuple[dict, str]] = []

    def add(self, doc: dict, where: str) -> None:
        rollout, train = doc["rollout_log_probs"], doc["train_log_probs"]
        n = len(rollout)
        if len(train) != n:
            raise ValueError(f"{len(rollout)} rollout but {len(train)} training log-probs")
        tokens = doc.get("response_ids")
        if tokens is None or len(tokens) != n:
            tokens = [-1] * n
        if n == 0:  # nothing verl's mask counts: a request, no tokens
            step = doc.get("step")
            stats = self.result.steps.get(step) or self.result.steps.setdefault(step, StepStats(step))
            stats.requests += 1
            return
        mask = doc.get("mask")
        if mask is not None:
            self.masks.append((len(self.lengths), mask))
        self.rollout += rollout
        self.train += train
        self.tokens += tokens
        self.lengths.append(n)
        self.line_steps.append(doc.get("step"))
        self.docs.append((doc, where))
        if len(self.lengths) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self.lengths:
            return
        np, res = self.np, self.result
        lengths = np.asarray(self.lengths, np.int64)
        starts = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        try:
            r = np.asarray(self.rollout, np.float64)
            t = np.asarray(self.train, np.float64)
        except TypeError:  # a null (non-finite) value
            r = np.asarray([math.nan if v is None else v for v in self.rollout], np.float64)
            t = np.asarray([math.nan if v is None else v for v in self.train], np.float64)
        valid = np.ones(len(r), bool)
        for line, mask in self.masks:
            seg = valid[starts[line] : starts[line] + lengths[line]]
            seg[:] = np.asarray(mask[: len(seg)], bool) if len(mask) >= len(seg) else False
        finite = np.isfinite(r) & np.isfinite(t)
        res.nonfinite += int((valid & ~finite).sum())
        valid &= finite
        r = np.where(valid, r, 0.0)
        t = np.where(valid, t, 0.0)
        gaps = {"dlogp": np.abs(t - r), "dp": np.abs(np.exp(t) - np.exp(r))}
        pos = np.arange(len(r), dtype=np.int64) - np.repeat(starts, lengths)
        tokens = np.asarray(self.tokens, np.int64)
        # steps of this chunk -> local ids, one per token
        local: dict[Any, int] = {}
        line_step = np.asarray([local.setdefault(s, len(local)) for s in self.line_steps], np.int64)
        token_step = np.repeat(line_step, lengths)
        vpos, vtok, vstep = pos[valid], tokens[valid], token_step[valid]
        counts_line = np.add.reduceat(valid.astype(np.int64), starts) if len(r) else np.zeros(0, np.int64)
        counts_line = np.where(lengths > 0, counts_line, 0)
        line_stats = {}
        for q, g in gaps.items():
            gv = g[valid]
            bins = _bins(np, gv)
            self._steps(q, gv, bins, vstep, local)
            self._overall(q, gv, bins)
            res.by_position[q] = _grow_add(np, res.by_position[q], vpos, gv)
            ok_tok = vtok >= 0
            res.by_token[q] = _grow_add(np, res.by_token[q], vtok[ok_tok], gv[ok_tok])
            masked = np.where(valid, g, 0.0)
            sums = np.add.reduceat(masked, starts) if len(r) else np.zeros(0)
            peaks = np.maximum.reduceat(masked, starts) if len(r) else np.zeros(0)
            line_stats[q] = (np.where(lengths > 0, sums, 0.0), np.where(lengths > 0, peaks, 0.0))
        for step, k in local.items():
            res.steps[step].requests += int((line_step == k).sum())
        self._worst(line_stats, counts_line, starts, lengths, gaps, tokens, r, t)
        self._reset()

    def _steps(self, q: str, gv: Any, bins: Any, vstep: Any, local: dict[Any, int]) -> None:
        np = self.np
        for step, k in local.items():
            stats = self.result.steps.get(step)
            if stats is None:
                stats = self.result.steps[step] = StepStats(step)
            gap = stats.gaps.get(q)
            if gap is None:
                gap = stats.gaps[q] = Gap(hist=np.zeros(N_BINS, np.int64))
            sel = vstep == k if len(local) > 1 else slice(None)
            _fold(np, gap, gv[sel], bins[sel])

    def _overall(self, q: str, gv: Any, bins: Any) -> None:
        _fold(self.np, self.result.overall[q], gv, bins)

    def _worst(self, stats, counts, starts, lengths, gaps, tokens, r, t) -> None:
        np = self.np
        sum_l, peak_l = stats["dlogp"]
        sum_p, _ = stats["dp"]
        floor = self.heap[0].key if len(self.heap) >= self.keep else None
        step_worst = self.result.step_worst
        for i in np.flatnonzero(counts > 0):
            key = (float(peak_l[i]), float(sum_l[i] / counts[i]))
            doc, where = self.docs[i]
            step = doc.get("step")
            best = step_worst.get(step)
            to_heap = floor is None or key > floor
            if not to_heap and best is not None and key <= best.key:
                continue
            a, n = int(starts[i]), int(lengths[i])
            seg = gaps["dlogp"][a : a + n]
            top = np.argsort(seg)[::-1][:5]
            positions = [
                {
                    "position": int(p),
                    "token_id": int(tokens[a + p]),
                    "rollout_log_prob": float(r[a + p]),
                    "train_log_prob": float(t[a + p]),
                    "dlogp": float(seg[p]),
                }
                for p in top
                if seg[p] > 0
            ]
            worst = Worst(
                key,
                step,
                doc.get("request_id"),
                doc.get("uid"),
                doc.get("index"),
                doc.get("prompt_len"),
                n,
                float(sum_l[i] / counts[i]),
                float(sum_p[i] / counts[i]),
                positions,
                where,
                doc.get("prompt_ids"),
                doc.get("sample"),
            )
            if best is None or key > best.key:
                step_worst[step] = worst
            if not to_heap:
                continue
            if len(self.heap) < self.keep:
                heapq.heappush(self.heap, worst)
            else:
                heapq.heapreplace(self.heap, worst)
            floor = self.heap[0].key if len(self.heap) >= self.keep else None


def _bins(np: Any, values: Any) -> Any:
    with np.errstate(divide="ignore"):
        b = np.ceil((np.log10(values) - LOW_DECADE) * BINS_PER_DECADE)
    return np.clip(np.nan_to_num(b, nan=0.0, neginf=0.0), 0, N_BINS - 1).astype(np.int64)


def _fold(np: Any, gap: Gap, values: Any, bins: Any) -> None:
    if not len(values):
        return
    gap.count += int(len(values))
    gap.total += float(values.sum())
    gap.squares += float(np.dot(values, values))
    gap.peak = max(gap.peak, float(values.max()))
    gap.hist += np.bincount(bins, minlength=N_BINS)


def _grow_add(np: Any, acc: tuple[Any, Any], index: Any, values: Any) -> tuple[Any, Any]:
    sums, counts = acc
    if not len(index):
        return acc
    size = int(index.max()) + 1
    if size > len(sums):
        sums = np.concatenate([sums, np.zeros(size - len(sums))])
        counts = np.concatenate([counts, np.zeros(size - len(counts), np.int64)])
    sums[:size] += np.bincount(index, weights=values, minlength=size)
    counts[:size] += np.bincount(index, minlength=size)
    return sums, counts


def log_files(root: Path) -> list[Path]:
    """Every triage.jsonl under root ({root}/{pid}/triage.jsonl, or root itself when it is one)."""
    if root.is_file():
        return [root]
    files = list(walk_files(root, {LOG_NAME}, max_depth=3))
    if not files:
        raise UserError(
            f"{root}: no {LOG_NAME} below it. Pass the folder RL_MSPROBE_TRIAGE pointed at (it holds "
            f"<pid>/{LOG_NAME}), after a run prepared with `rl-msprobe prepare --mode triage` and patched with verl-triage."
        )
    return files


def read_triage(root: Path, keep: int = 10) -> Triage:
    """One streaming pass over every triage line under root."""
    result = Triage()
    acc = _Accumulator(result, keep)
    loads = json.loads
    for path in log_files(root):
        result.files.append(str(path))
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                result.lines += 1
                try:
                    doc = loads(raw)
                    if "error" in doc:
                        result.error_count += 1
                        if len(result.errors) < 5:
                            result.errors.append(f"{path}:{number}: step {doc.get('step')}: {doc['error']}")
                        continue
                    acc.add(doc, f"{path}:{number}")
                except (ValueError, KeyError, TypeError) as exc:
                    if not raw.strip():
                        result.lines -= 1
                        continue
                    result.bad_count += 1
                    if len(result.bad_lines) < 5:
                        result.bad_lines.append(f"{path}:{number}: {type(exc).__name__}: {exc}"[:300])
                    continue
                result.requests += 1
    acc.flush()
    result.worst = sorted(acc.heap, reverse=True)
    return result

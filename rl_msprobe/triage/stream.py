"""Stream triage lines (`<dir>/<pid>/triage.jsonl`) into bounded per-step, per-position and per-token sums.

Quantities are verl's own (`verl/utils/debug/metrics.py`, 0.9.1): over the response tokens
verl's mask counts, |Δp| = |exp(train log p) − exp(rollout log p)| is what verl logs as
`training/rollout_probs_diff_{mean,max,std}` (token mean over the whole step; std unbiased),
with each exp rounded to its tensor's dtype as torch does (float32, or bf16 when the training
engine computes in bf16: the line says `train_dtype`);
|Δ log p| = |train log p − rollout log p| is the same gap in log space. Mean, max and std are
exact; p99 comes from a histogram with 64 bins per power of two (within 1.1%), binned on
the float's own bits (exponent and top mantissa bits), which costs no logarithm.

A line the helper wrote ends with its id and log-prob arrays (`split_tail`): json reads the
small head, numpy reads the arrays of a whole chunk of lines at once, and the prompt ids stay
text unless the request is among the worst; any other line is read whole by json, with the
same result. So a report costs about what parsing the lines with json costs
(benchmarks/bench_mismatch_report.py). Memory holds one chunk, a bounded batch of token gaps,
one entry per step, per response position and per token id, and the `keep` worst requests:
never one per line.
"""

from __future__ import annotations

import heapq
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

from rl_msprobe import bounded
from rl_msprobe.dumps.layout import walk_files
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

LOG_NAME = "triage.jsonl"
CHUNK = 1024  # lines reduced together
TOKEN_BATCH = 1 << 16  # token gaps gathered before one pass over the vocabulary-long sums
MANTISSA_BITS = 6  # 2**6 bins per power of two
_SHIFT = 52 - MANTISSA_BITS
LOW_EXP, HIGH_EXP = -30, 8  # |Δ| below 2**-30 (and exact zeros) fall in bin 0; above 2**8 in the last
_LOW_KEY = (1023 + LOW_EXP) << MANTISSA_BITS
N_BINS = 2 + ((HIGH_EXP - LOW_EXP) << MANTISSA_BITS)
QUANTITIES = ("dlogp", "dp")  # |Δ log p|, |Δp|
# what a real run produces, with room: a larger step or token id is a line rl-msprobe's helper did not
# write (a token id of 3e8 would ask numpy for GiBs of per-token sums)
MAX_STEP = 10_000_000
MAX_TOKEN_ID = 1 << 24  # 16.7M; the largest vocabularies are ~256k
_SCALARS = (str, int, float, type(None))
# a line's step or id as check_head lets it through: a string or a number (None: absent)
Scalar: TypeAlias = str | int | float | None


def _np() -> ModuleType:
    """numpy, imported on first use (its arrays are `Any` to the checker here)."""
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
    """The upper edge of bin b (bin 0: below 2**LOW_EXP)."""
    import struct

    key = _LOW_KEY + b
    upper: float = struct.unpack("<d", struct.pack("<q", key << _SHIFT))[0]
    return upper


@dataclass
class StepStats:
    step: Scalar
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
    step: Scalar = field(compare=False)
    request_id: Scalar = field(compare=False)
    uid: Scalar = field(compare=False)
    index: Scalar = field(compare=False)
    prompt_len: Scalar = field(compare=False)
    response_len: int = field(compare=False)
    mean_dlogp: float = field(compare=False)
    mean_dp: float = field(compare=False)
    positions: list[dict[str, Any]] = field(compare=False)  # the worst positions of this request
    where: str = field(compare=False)  # file:line
    prompt_ids: list[int] | None = field(compare=False, default=None)
    sample: dict[str, Any] | None = field(compare=False, default=None)

    def to_json(self, full: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
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
    blank: int = 0  # empty lines (not counted as lines)
    nonfinite: int = 0  # tokens with a non-finite log-prob (left out, as a NaN would poison verl's mean)
    steps: dict[Any, StepStats] = field(default_factory=dict)
    overall: dict[str, Gap] = field(default_factory=dict)
    by_position: dict[str, Any] = field(default_factory=dict)  # q -> (sum, count) numpy arrays
    by_token: dict[str, Any] = field(default_factory=dict)  # q -> (sum, count) numpy arrays
    worst: list[Worst] = field(default_factory=list)  # the worst requests, worst first
    step_worst: dict[Scalar, Worst] = field(default_factory=dict)  # each step's worst request

    def step_list(self) -> list[StepStats]:
        return [self.steps[k] for k in sorted(self.steps, key=step_order)]


def step_order(step: Scalar) -> tuple[int, float | str]:
    return (0, step) if isinstance(step, (int, float)) else (1, str(step))


class _Accumulator:
    """Gathers parsed lines into a chunk; `flush` reduces it into the Triage with numpy."""

    def __init__(self, result: Triage, keep: int) -> None:
        self.np = _np()
        self.result = result
        self.keep = keep
        self.heap: list[Worst] = []
        self._tokens: list[tuple[Any, dict[str, Any]]] = []  # token ids and their gaps, not yet summed
        self._token_count = 0
        self._reset()
        for q in QUANTITIES:
            result.overall[q] = Gap(hist=self.np.zeros(N_BINS, self.np.int64))
            result.by_position[q] = (self.np.zeros(0), self.np.zeros(0, self.np.int64))
            result.by_token[q] = (self.np.zeros(0), self.np.zeros(0, self.np.int64))

    def fold_tokens(self) -> None:
        """Add the gathered token gaps to the per-token sums: one pass over arrays as long as the
        vocabulary for many chunks, not one per chunk."""
        if not self._tokens:
            return
        np = self.np
        index = np.concatenate([k for k, _ in self._tokens])
        gaps = {q: np.concatenate([g[q] for _, g in self._tokens]) for q in QUANTITIES}
        self.result.by_token = _grow_add(np, self.result.by_token, index, gaps)
        self._tokens, self._token_count = [], 0

    def _reset(self) -> None:
        self.docs: list[JsonObject] = []
        self.where: list[tuple[str, int]] = []
        self.tails: list[tuple[bytes, bytes, bytes] | None] = []  # the array texts of a fast line
        self.raws: list[bytes] = []

    def flush(self) -> None:
        columns = self._columns() if self.docs else None
        docs = self.docs
        if columns is None or not docs:
            self._reset()
            return
        np, res = self.np, self.result
        lengths, r, t, tokens = columns
        starts = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        total = int(lengths.sum())
        valid = np.ones(total, bool)
        for i, doc in enumerate(docs):
            mask = doc.get("mask")
            if mask is not None:
                seg = valid[starts[i] : starts[i] + lengths[i]]
                seg[:] = np.asarray(mask[: len(seg)], bool) if len(mask) >= len(seg) else False
        finite = np.isfinite(r) & np.isfinite(t)
        res.nonfinite += int((valid & ~finite).sum())
        valid &= finite
        r = np.where(valid, r, 0.0)
        t = np.where(valid, t, 0.0)
        p_t = _as_stored(np, np.exp(t), [d.get("train_dtype") for d in docs], lengths)
        p_r = _as_stored(np, np.exp(r), [d.get("rollout_dtype") for d in docs], lengths)
        gaps = {"dlogp": np.abs(t - r), "dp": np.abs(p_t - p_r)}
        local: dict[Scalar, int] = {}  # this chunk's steps -> local ids
        line_step = np.fromiter(
            [local.setdefault(d.get("step"), len(local)) for d in docs], np.int64, len(docs)
        )
        vstep = np.repeat(line_step, lengths)[valid]
        vpos = (np.arange(total, dtype=np.int64) - np.repeat(starts, lengths))[valid]
        vtok = tokens[valid]
        known = (vtok >= 0) & (vtok <= MAX_TOKEN_ID)
        beyond = int((vtok > MAX_TOKEN_ID).sum())
        if beyond:
            res.bad_count += 1
            if len(res.bad_lines) < 5:
                res.bad_lines.append(
                    f"{beyond} token id(s) above {MAX_TOKEN_ID:,} (no vocabulary is that large): "
                    "left out of the per-token sums"
                )
        valid_gaps = {q: g[valid] for q, g in gaps.items()}
        res.by_position = _grow_add(np, res.by_position, vpos, valid_gaps)
        self._tokens.append((vtok[known], {q: g[known] for q, g in valid_gaps.items()}))
        self._token_count += int(known.sum())
        if self._token_count >= TOKEN_BATCH:
            self.fold_tokens()
        line_stats: dict[str, tuple[Any, Any]] = {}  # quantity -> (sum, peak) per line
        for q, g in gaps.items():
            gv = valid_gaps[q]
            bins = _bins(np, gv)
            self._steps(q, gv, bins, vstep, local)
            _fold(np, res.overall[q], gv, bins)
            masked = np.where(valid, g, 0.0)
            line_stats[q] = (np.add.reduceat(masked, starts), np.maximum.reduceat(masked, starts))
        for step, k in local.items():
            res.steps[step].requests += int((line_step == k).sum())
        counts = np.add.reduceat(valid.astype(np.int64), starts)
        self._worst(line_stats, counts, starts, lengths, gaps, tokens, r, t)
        self._reset()

    def _columns(self) -> tuple[Any, Any, Any, Any]:
        """The chunk's response lengths and its log-probs and token ids end to end, for the lines
        kept (two equally long log-prob arrays); the other lines are counted, not read."""
        columns = self._fast() if None not in self.tails else None
        if columns is None:
            self._parse_whole()
            columns = self._slow()
        return self._select(*columns)

    def _fast(self) -> tuple[Any, ...] | None:
        """Every line of the chunk ended with the helper's three arrays: one numpy parse per array
        for the whole chunk. None when any number does not parse (then the lines go through json)."""
        np = self.np
        ids, rollout, train = zip(*self.tails)
        out = []
        for pieces, dtype in ((rollout, np.float64), (train, np.float64), (ids, np.int64)):
            counts = np.fromiter([p.count(b",") + 1 if p else 0 for p in pieces], np.int64, len(pieces))
            values = _numbers(np, pieces, dtype)
            if values is None or len(values) != counts.sum():
                return None
            out.append((counts, values))
        (lr, r), (lt, t), (lk, k) = out
        return lr, lt, lk, r, t, k

    def _parse_whole(self) -> None:
        """The fast lines of a chunk that numpy could not read, read again whole by json (a line json
        refuses is a bad line, as it would have been without the fast path)."""
        if all(tail is None for tail in self.tails):
            return
        res = self.result
        keep = []
        for i, tail in enumerate(self.tails):
            if tail is not None:
                try:
                    self.docs[i] = json.loads(self.raws[i])
                except (ValueError, RecursionError) as exc:
                    res.bad_count += 1
                    if len(res.bad_lines) < 5:
                        res.bad_lines.append(
                            "{}:{}: ".format(*self.where[i]) + f"{type(exc).__name__}: {exc}"[:300]
                        )
                    continue
            keep.append(i)
        self.docs = [self.docs[i] for i in keep]
        self.where = [self.where[i] for i in keep]

    def _slow(self) -> tuple[Any, ...]:
        """Lengths and arrays from the parsed lines (lines without the two arrays become bad lines)."""
        np, docs = self.np, self.docs
        try:
            lr = np.fromiter([len(d["rollout_log_probs"]) for d in docs], np.int64, len(docs))
            lt = np.fromiter([len(d["train_log_probs"]) for d in docs], np.int64, len(docs))
            tok = [d.get("response_ids") for d in docs]
            lk = np.fromiter([-1 if v is None else len(v) for v in tok], np.int64, len(docs))
        except (KeyError, TypeError, AttributeError):
            lr, lt, lk = self._validate_slowly()
            docs = self.docs
        r = _column(np, docs, "rollout_log_probs", int(lr.sum()), np.float64, math.nan)
        t = _column(np, docs, "train_log_probs", int(lt.sum()), np.float64, math.nan)
        known = [d for d, n in zip(docs, lk.tolist()) if n > 0]
        k = _column(np, known, "response_ids", int(lk[lk > 0].sum()), np.int64, -1)
        return lr, lt, lk, r, t, k

    def _select(self, lr: Any, lt: Any, lk: Any, r: Any, t: Any, k: Any) -> tuple[Any, Any, Any, Any]:
        """Keep the lines whose two log-prob arrays are equally long (a token array of another
        length becomes unknown tokens, -1); count and name the rest."""
        np, res, docs = self.np, self.result, self.docs
        same = lr == lt
        keep = same & (lr > 0)
        res.requests += int(same.sum())
        known = lk == lr
        if keep.all() and known.all():
            return lr, r, t, k
        for i in np.flatnonzero(~same):
            res.bad_count += 1
            if len(res.bad_lines) < 5:
                res.bad_lines.append(
                    "{}:{}: ".format(*self.where[i]) + f"{lr[i]} rollout but {lt[i]} training log-probs"
                )
        for i in np.flatnonzero(same & (lr == 0)):  # nothing verl's mask counts: a request, no tokens
            step = docs[i].get("step")
            res.steps.setdefault(step, StepStats(step)).requests += 1
        index = np.flatnonzero(keep)
        self.docs = [docs[i] for i in index]
        self.where = [self.where[i] for i in index]
        lengths = lr[index]
        tokens = np.full(int(lengths.sum()), -1, np.int64)
        tokens[np.repeat(known[index], lengths)] = k[np.repeat(keep & known, np.maximum(lk, 0))]
        return lengths, r[np.repeat(keep, lr)], t[np.repeat(keep, lt)], tokens

    def _validate_slowly(self) -> tuple[Any, Any, Any]:
        """Line by line: a line that is not an object with the two arrays becomes a bad line."""
        good: list[tuple[JsonObject, tuple[int, int, int]]] = []
        where: list[tuple[str, int]] = []
        for doc, at in zip(self.docs, self.where):
            try:
                rollout_n, train_n = len(doc["rollout_log_probs"]), len(doc["train_log_probs"])
                tokens = doc.get("response_ids")
                lengths = (rollout_n, train_n, -1 if tokens is None else len(tokens))
            except (KeyError, TypeError, AttributeError) as exc:
                self.result.bad_count += 1
                if len(self.result.bad_lines) < 5:
                    self.result.bad_lines.append("{}:{}: ".format(*at) + f"{type(exc).__name__}: {exc}")
                continue
            good.append((doc, lengths))
            where.append(at)
        self.docs, self.where = [d for d, _ in good], where
        np = self.np
        rollout, train, response = (
            np.asarray([n[k] for _, n in good], np.int64).reshape(-1) for k in range(3)
        )
        return rollout, train, response

    def _steps(self, q: str, gv: Any, bins: Any, vstep: Any, local: dict[Scalar, int]) -> None:
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

    def _candidates(self, np: Any, peak: Any, counts: Any, steps: list[Scalar]) -> list[int]:
        """The only lines of a chunk that can enter the worst list: its `keep` largest peaks, and
        each step's largest (if above the heap's floor or that step's worst so far)."""
        peak = np.where(counts > 0, peak, -1.0)
        k = min(self.keep, len(peak))
        found = set(np.argpartition(-peak, k - 1)[:k].tolist()) if k else set()
        first: dict[Any, int] = {}
        for i, step in enumerate(steps):
            j = first.setdefault(step, i)
            if peak[i] > peak[j]:
                first[step] = i
        found.update(first.values())
        return sorted(i for i in found if peak[i] >= 0)

    def _worst(
        self,
        stats: dict[str, tuple[Any, Any]],
        counts: Any,
        starts: Any,
        lengths: Any,
        gaps: dict[str, Any],
        tokens: Any,
        r: Any,
        t: Any,
    ) -> None:
        """Offer the chunk's candidate lines to the worst-request heap and each step's worst
        (`stats`: quantity -> (sum, peak) per line; the rest numpy arrays of the chunk)."""
        np = self.np
        sum_l, peak_l = stats["dlogp"]
        sum_p, _ = stats["dp"]
        floor = self.heap[0].key if len(self.heap) >= self.keep else None
        step_worst = self.result.step_worst
        steps = [d.get("step") for d in self.docs]
        for i in self._candidates(np, peak_l, counts, steps):
            key = (float(peak_l[i]), float(sum_l[i] / counts[i]))
            doc = self.docs[i]
            where = "{}:{}".format(*self.where[i])
            step = steps[i]
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
                _prompt_ids(doc.get("prompt_ids")),
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
    """Histogram bins of non-negative floats from their bits: monotonic, 2**MANTISSA_BITS per octave."""
    keys = (values.view(np.int64) >> _SHIFT) - (_LOW_KEY - 1)
    return np.clip(keys, 0, N_BINS - 1)


def _fold(np: Any, gap: Gap, values: Any, bins: Any) -> None:
    if not len(values):
        return
    gap.count += int(len(values))
    gap.total += float(values.sum())
    gap.squares += float((values * values).sum())  # not np.dot: BLAS threads cost more than they save here
    gap.peak = max(gap.peak, float(values.max()))
    gap.hist += np.bincount(bins, minlength=N_BINS)


def _grow_add(np: Any, acc: dict[str, Any], index: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Add values[q] at index into acc[q] = (sums, counts), growing the arrays to the largest index."""
    if not len(index):
        return acc
    size = int(index.max()) + 1
    counts = np.bincount(index, minlength=size)
    out = {}
    for q, (sums, total) in acc.items():
        if size > len(sums):
            sums = np.concatenate([sums, np.zeros(size - len(sums))])
            total = np.concatenate([total, np.zeros(size - len(total), np.int64)])
        sums[:size] += np.bincount(index, weights=values[q], minlength=size)
        total[:size] += counts
        out[q] = (sums, total)
    return out


def _as_stored(np: Any, values: Any, dtypes: list[Any], lengths: Any) -> Any:
    """Probabilities rounded to the dtype torch computes them in (float32 unless a line says bf16/fp16)."""
    out = values.astype(np.float32).astype(np.float64)
    for name in {d for d in dtypes if d and d != "float32"}:
        where = np.repeat(np.asarray([d == name for d in dtypes]), lengths)
        if name == "bfloat16":
            bits = values[where].astype(np.float32).view(np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
            out[where] = bits.astype(np.uint32).view(np.float32)
        elif name == "float16":
            out[where] = values[where].astype(np.float16)
    return out


def _column(np: Any, docs: list[JsonObject], key: str, total: int, dtype: Any, missing: Any) -> Any:
    """One key's arrays of every line, end to end (a null or a non-number becomes `missing`)."""
    try:
        return np.fromiter(chain.from_iterable([d[key] for d in docs]), dtype, total)
    except (TypeError, ValueError, OverflowError):  # a 30-digit number overflows int64 and float64 alike
        return np.asarray(
            [
                v
                if isinstance(v, float)
                or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62)
                else missing
                for d in docs
                for v in d[key]
            ],
            dtype,
        )


def _numbers(np: Any, pieces: tuple[bytes, ...], dtype: Any) -> Any:
    """The comma-separated numbers of every piece, end to end (numpy's C parser); None when one does not parse."""
    text = b",".join([p for p in pieces if p])
    if not text:
        return np.zeros(0, dtype)
    try:
        with warnings.catch_warnings():  # numpy < 2.4 only warns where the text stops parsing
            warnings.simplefilter("error", DeprecationWarning)
            return np.fromstring(text, dtype=dtype, sep=",")
    except (ValueError, DeprecationWarning):
        return None


_TAIL = b', "response_ids": ['
_ROLLOUT = b'], "rollout_log_probs": ['
_TRAIN = b'], "train_log_probs": ['
_PROMPT = b', "prompt_ids": ['
# json's own C scanner, without loads' checks for a BOM and spaces (typeshed omits the attribute)
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def split_tail(raw: bytes) -> tuple[bytes, tuple[bytes, bytes, bytes], bytes | None] | None:
    """A line that ends as the helper writes it (`..., "prompt_ids": [..], "response_ids": [..],
    "rollout_log_probs": [..], "train_log_probs": [..]}`): its head as an object's text, the three
    arrays' texts, and the prompt ids' text (None when the head holds them, e.g. as null).

    The arrays are then read by numpy (which must find exactly as many numbers as the commas
    say, or the chunk is read again by json), and the prompt ids only for the few worst requests.
    Safe: the arrays' texts hold no quote, so after the `"response_ids"` key the only quotes are
    the three keys' own, none of them inside a string; and the `}` that ends the line closes the
    object they are in, so when the head parses as an object they are the line's own keys.
    Anything else is None: json reads that line whole.
    """
    if raw[-3:] == b"]}\n":
        stop = len(raw) - 3
    else:
        end = raw.rstrip()
        if end[-2:] != b"]}":
            return None
        stop = len(end) - 2
    at = raw.find(_TAIL)
    r = raw.find(_ROLLOUT, at, stop)
    t = raw.find(_TRAIN, r, stop)
    if at < 2 or r < 0 or t < 0:
        return None
    tail = (raw[at + len(_TAIL) : r], raw[r + len(_ROLLOUT) : t], raw[t + len(_TRAIN) : stop])
    if b'"' in tail[0] or b'"' in tail[1] or b'"' in tail[2]:
        return None
    prompt = None
    if raw[at - 1 : at] == b"]":
        start = raw.find(_PROMPT, 0, at)
        if start > 1 and b'"' not in raw[start + len(_PROMPT) : at]:
            prompt = raw[start + len(_PROMPT) : at - 1]
            at = start
    return raw[:at] + b"}", tail, prompt


class PromptText(bytes):
    """A line's prompt ids, still as text: parsed only for the worst requests that show them."""

    def ids(self) -> list[int]:
        ids: list[int] = json.loads(b"[" + self + b"]")  # split_tail: digits and commas, no strings
        return ids


def _prompt_ids(value: Any) -> Any:
    try:
        return value.ids() if isinstance(value, PromptText) else value
    except ValueError:  # digits and commas that are not a list of numbers: as json would not read them
        return None


def _head(text: bytes) -> JsonObject:
    """The head of a split line as a dict (ValueError when it is not exactly one JSON object)."""
    try:
        decoded = text.decode("utf-8")
        doc, stop = _scan(decoded, 0)
    except StopIteration:
        raise ValueError("not a JSON object") from None
    if stop != len(decoded) or type(doc) is not dict or not doc:
        raise ValueError("not a JSON object")
    return doc


class BadNumber(UserError):
    """A number in a triage line that the helper never writes (read_triage names the file and line)."""


def _shown(value: int | float) -> str:
    """A number as the line has it: Infinity, -Infinity, NaN (1e400 reads as Infinity), digits."""
    if isinstance(value, float):
        return json.dumps(value) if not math.isfinite(value) else repr(value)
    text = repr(value) if value.bit_length() < 13_000 else "a 4,000-digit number"
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} digits)"


def check_head(doc: Any) -> None:
    """A parsed line's small fields as the helper writes them (TypeError / ValueError naming the key
    otherwise): a step that is a number up to MAX_STEP or a string, scalar ids, a mask that is a list."""
    if type(doc) is not dict:
        raise TypeError(f"a JSON {type(doc).__name__}, not an object")
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, _SCALARS):
        raise TypeError(f"`step` is a {type(step).__name__}, not a number")
    for key in ("step", "index", "prompt_len"):  # whole numbers where they are numbers at all
        value = doc.get(key)
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            limit = MAX_STEP if key == "step" else MAX_TOKEN_ID * 64
            whole = isinstance(value, int) or (math.isfinite(value) and value.is_integer())
            if not whole or not 0 <= value <= limit:
                raise BadNumber(
                    f"`{key}` is {_shown(value)}; the triage helper writes a whole number in 0..{limit:,} "
                    "there (the trainer's global step, the row in the batch, the prompt's length). The log was "
                    "edited or is not the helper's: fix or remove that line."
                )
    for key in ("request_id", "uid", "index", "prompt_len", "train_dtype", "rollout_dtype", "error"):
        if not isinstance(doc.get(key), _SCALARS):
            raise TypeError(f"`{key}` is a {type(doc[key]).__name__}, not a string or number")
    for key in ("mask", "response_ids", "prompt_ids"):
        if not isinstance(doc.get(key), (list, type(None), PromptText)):
            raise TypeError(f"`{key}` is a {type(doc[key]).__name__}, not a list")
    for key in ("rollout_log_probs", "train_log_probs"):
        if key in doc and not isinstance(doc[key], list):
            raise TypeError(f"`{key}` is a {type(doc[key]).__name__}, not a list")


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
        name = str(path)
        result.files.append(name)
        docs, where, tails, raws = acc.docs, acc.where, acc.tails, acc.raws
        with bounded.open_regular(path, "triage log") as f:
            number = 0
            for number, raw in enumerate(bounded.lines(f, path, "triage"), 1):  # noqa: B007 - counted after
                try:
                    split = split_tail(raw)
                    if split is None:
                        doc, tail = loads(raw), None
                    else:
                        try:
                            doc, tail = _head(split[0]), split[1]
                            if split[2] is not None:
                                doc["prompt_ids"] = PromptText(split[2])
                        except ValueError:
                            doc, tail = loads(raw), None  # says where the line itself is broken
                    try:
                        check_head(doc)
                    except BadNumber as exc:
                        raise UserError(f"{path}:{number}: {exc}") from None
                    if "error" in doc:
                        result.error_count += 1
                        if len(result.errors) < 5:
                            result.errors.append(f"{path}:{number}: step {doc.get('step')}: {doc['error']}")
                        continue
                except (ValueError, KeyError, TypeError, RecursionError) as exc:
                    if not raw.strip():
                        result.blank += 1
                        continue
                    result.bad_count += 1
                    if len(result.bad_lines) < 5:
                        result.bad_lines.append(f"{path}:{number}: {type(exc).__name__}: {exc}"[:300])
                    continue
                docs.append(doc)
                where.append((name, number))
                tails.append(tail)
                raws.append(raw)
                if len(docs) >= CHUNK:
                    acc.flush()
                    docs, where, tails, raws = acc.docs, acc.where, acc.tails, acc.raws
            result.lines += number
    result.lines -= result.blank
    acc.flush()
    acc.fold_tokens()
    result.worst = sorted(acc.heap, reverse=True)
    return result

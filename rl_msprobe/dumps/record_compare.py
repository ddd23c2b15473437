"""Whole-response consistency from per-token records on both sides (docs/records.md): every
position of every recorded request, the prompt row by row and every decode position.

Per request (its base id), the rollout's and the trainer's records (`records.read_side`) meet:

- TP ranks of the rollout merge exactly, per position and tensor, against the width of the
  training tensor it is compared with: rank widths that add up to it are shards (column-parallel
  outputs, row-parallel inputs, fused qkv / gate_up against the training parts `fused.parts_of`
  finds): max of max, min of min, root of the sum of squared norms; ranks each as wide as it are
  replicated and must agree (`tp_merge.AGREE`): a rank that differs is a finding at that module and
  position, naming the rank (how a fault on one TP rank shows), never dropped.
- modules are paired by name as `positions.pairings` pairs them (FSDP wrappers and classes
  dropped, fused parts, vLLM's conventions of `summary.apply_engine_conventions`); vLLM's
  `logits_processor` meets the training `lm_head`; rows of vLLM's logits (one per sampled
  position) meet the training rows at those positions.
- the token ids (the embedding's integer input) must agree at every position, else NOT COMPARED
  naming the first position that differs; positions missing on a side or a TP rank, values that
  are not numbers, coverage below one half: NOT COMPARED, saying which.
- every position goes through `judge`'s rule (`judge.judge_arrays`, all positions at once); the
  result is a `positions.Result` (`RecordResult`), so the report (`position_report`) is one shape.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from rl_msprobe.dumps import records as rec
from rl_msprobe.dumps.judge import (
    NOISE_FLOOR,
    JudgedModule,
    Judgement,
    is_integer,
    judge_arrays,
    precision_of,
)
from rl_msprobe.dumps.positions import (
    Forward,
    Pairing,
    Position,
    Result,
    ids_leaf,
    pairings,
    plain_name,
)
from rl_msprobe.dumps.summary import apply_engine_conventions, module_of, own_row
from rl_msprobe.dumps.tp_merge import AGREE, COLUMN, shard_dim
from rl_msprobe.dumps.whole_response import RequestResult
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

Array = Any  # numpy arrays
ALIASES = {"logits_processor": "lm_head"}  # vLLM's last module -> the training one it is compared with


def ranges(positions: Sequence[int], most: int = 6) -> str:
    """`3-7, 9, 12-13` (the first MOST runs, then how many more)."""
    runs: list[list[int]] = []
    for p in sorted(positions):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" (and {len(runs) - most} more runs)" if len(runs) > most else "")


# ------------------------------------------------------------------ the result
@dataclass
class RecordResult(Result):
    """A `positions.Result` whose per-position judgements live in arrays (positions x modules),
    made into `Position` / `Judgement` objects only where asked: a request of 10k positions and
    thousands of modules stays arrays."""

    phases: list[str] = field(default_factory=list)
    modules: list[tuple[str, int | None, JudgedModule, list[tuple[int, str, str]]]] = field(
        default_factory=list
    )
    tp: dict[tuple[int, int], tuple[str, float]] = field(
        default_factory=dict
    )  # (module, position) -> rank text
    repeated: int = 0

    def __post_init__(self) -> None:
        self.positions = _Lazy(self)

    # module m at position p, as judge would have made it
    def judgement(self, m: int, p: int) -> Judgement:
        name, layer, jm, outs = self.modules[m]
        w = int(jm.worst[p])
        index, label, precision = outs[w]
        tp = self.tp.get((m, p))
        return Judgement(
            index,
            name,
            label if tp is None else tp[0],
            layer,
            float(jm.error[p]) if tp is None else max(float(jm.error[p]), tp[1]),
            float(jm.received[p]),
            float(jm.floor[p]),
            precision,
            bool(jm.divergent[p]),
        )

    def position(self, p: int) -> Position:
        import numpy as np

        rows = [m for m, (_, _, jm, _) in enumerate(self.modules) if bool(np.asarray(jm.measured)[p])]
        js = sorted((self.judgement(m, p) for m in rows), key=lambda j: j.index)
        return Position(p, p + 1, self.phases[p], tuple(js))

    def _grid(self) -> tuple[Array, Array, Array, Array, Array]:
        """(measured, error, floor, divergent, index of the worst output) as [modules, positions]."""
        import numpy as np

        if not self.modules:
            z = np.zeros((0, len(self.phases)))
            return z.astype(bool), z, z, z.astype(bool), z.astype(np.int64)
        measured = np.stack([np.asarray(jm.measured) for _, _, jm, _ in self.modules])
        error = np.stack([np.asarray(jm.error) for _, _, jm, _ in self.modules])
        floor = np.stack([np.asarray(jm.floor) for _, _, jm, _ in self.modules])
        divergent = np.stack([np.asarray(jm.divergent) for _, _, jm, _ in self.modules])
        index = np.stack(
            [np.array([i for i, _, _ in outs])[np.asarray(jm.worst)] for _, _, jm, outs in self.modules]
        )
        return measured, error, floor, divergent, index

    @property
    def first(self) -> tuple[Position, Judgement] | None:
        import numpy as np

        _, _, _, divergent, index = self._grid()
        if not divergent.any():
            return None
        p = int(np.flatnonzero(divergent.any(axis=0))[0])
        m = int(np.argmin(np.where(divergent[:, p], index[:, p], np.iinfo(np.int64).max)))
        return Position(p, p + 1, self.phases[p], ()), self.judgement(m, p)

    @property
    def unjudged(self) -> list[int]:
        import numpy as np

        measured = self._grid()[0]
        return [int(p) for p in np.flatnonzero(~measured.any(axis=0))] if len(self.phases) else []

    def spans(self) -> list[tuple[int, int, str]]:
        return [(p, p + 1, phase) for p, phase in enumerate(self.phases)]

    def divergent_spans(self) -> int:
        return int(self._grid()[3].any(axis=0).sum()) if self.modules else 0

    def judged(self) -> tuple[int, dict[str, float]]:
        measured = self._grid()[0]
        floors = {
            precision: NOISE_FLOOR.get(precision, NOISE_FLOOR["fp32"])
            for _, _, jm, outs in self.modules
            if jm.measured.any()
            for _, _, precision in outs
        }
        return int(measured.sum()), floors

    def summaries(self) -> list[tuple[Position, Judgement | None, Judgement | None, int, float | None]]:
        import numpy as np

        measured, error, floor, divergent, index = self._grid()
        if not self.modules:
            return [(Position(p, p + 1, ph, ()), None, None, 0, None) for p, ph in enumerate(self.phases)]
        ratio = np.where(measured, error / floor, -np.inf)
        worst_m = np.argmax(ratio, axis=0)
        first_m = np.argmin(np.where(divergent, index, np.iinfo(np.int64).max), axis=0)
        largest = np.max(np.where(measured, error, -np.inf), axis=0)
        counts = measured.sum(axis=0)
        out: list[tuple[Position, Judgement | None, Judgement | None, int, float | None]] = []
        for p, phase in enumerate(self.phases):
            any_measured = bool(counts[p])
            out.append(
                (
                    Position(p, p + 1, phase, ()),
                    self.judgement(int(first_m[p]), p) if divergent[:, p].any() else None,
                    self.judgement(int(worst_m[p]), p) if any_measured else None,
                    int(counts[p]),
                    float(largest[p]) if any_measured else None,
                )
            )
        return out

    def layer_map(self) -> tuple[list[str], list[list[float | None]]]:
        import numpy as np

        measured, error, floor, _, _ = self._grid()
        labels: list[str] = []
        seen_layer = False
        for _, layer, _, _ in self.modules:
            seen_layer = seen_layer or layer is not None
            labels.append(str(layer) if layer is not None else ("head" if seen_layer else "embed"))
        ordered = sorted(
            set(labels), key=lambda s: -1 if s == "embed" else (10**9 if s == "head" else int(s))
        )
        ratio = np.where(measured, error / np.where(floor > 0, floor, 1.0), np.nan)
        grid: list[list[float | None]] = [[None] * len(ordered) for _ in self.phases]
        for i, lab in enumerate(ordered):
            rows = [m for m, x in enumerate(labels) if x == lab]
            block = ratio[rows]
            has = ~np.isnan(block).all(axis=0)
            best = np.max(np.where(np.isnan(block), -np.inf, block), axis=0)
            for p in np.flatnonzero(has):
                grid[int(p)][i] = float(best[p])
        return ordered, grid


class _Lazy(Sequence[Position]):
    """A RecordResult's positions, each made when asked."""

    def __init__(self, result: RecordResult) -> None:
        self.result = result

    def __len__(self) -> int:
        return len(self.result.phases)

    @overload
    def __getitem__(self, i: int) -> Position: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Position]: ...
    def __getitem__(self, i: int | slice) -> Position | Sequence[Position]:
        if isinstance(i, slice):
            return [self.result.position(p) for p in range(len(self))[i]]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.result.position(i % len(self))

    def __iter__(self) -> Iterator[Position]:
        return (self.result.position(p) for p in range(len(self)))


# ------------------------------------------------------------------ one request
def _leaf(
    dtype: str, length: int, width: int, stats: tuple[float, float, float] = (0.0, 0.0, 0.0)
) -> JsonObject:
    return {
        "type": "torch.Tensor",
        "dtype": dtype,
        "shape": [length, width],
        "Max": stats[0],
        "Min": stats[1],
        "Norm": stats[2],
    }


def _view(
    side: rec.SideRecords,
    arrays: dict[int, Array],
    present: list[int],
    rename: dict[str, str],
    path: Path,
    whole: Callable[[int], int] | None = None,
) -> Forward:
    """An msprobe-like view of one side's tensors of one request (what `pairings` and `fused` read);
    WHOLE: tensor index -> its whole row width, where the ranks' widths alone do not tell it."""
    import numpy as np

    data: dict[str, JsonObject] = {}
    first = arrays[min(arrays)]
    for i in present:
        key, label = side.tensors[i]
        key = rename.get(key, key)
        role, n = label.split(".")
        entry = data.setdefault(key, {"input_args": [], "output": []})
        items = entry["input_args" if role == "input" else "output"]
        assert isinstance(items, list)
        while len(items) <= int(n):
            items.append(None)
        widths = side.widths[i]
        cls = (plain_name(key) or ("", ""))[1]
        width = (
            whole(i)
            if whole is not None
            else sum(widths.values())
            if cls in COLUMN and role == "output" and len(widths) > 1
            else widths[min(widths)]
        )
        a = first[i]
        stats = (
            (float(np.nanmax(a[0])), float(np.nanmin(a[1])), float(math.sqrt(np.nansum(a[2] ** 2))))
            if not np.isnan(a[2]).all()
            else (0.0, 0.0, 0.0)
        )
        items[int(n)] = _leaf(side.dtypes[i], a.shape[-1], width, stats)
    return Forward(path, "records", data)


def _present(arrays: dict[int, Array]) -> list[int]:
    import numpy as np

    return sorted(
        {int(i) for a in arrays.values() for i in np.flatnonzero(~np.isnan(a[:, 2, :]).all(axis=1))}
    )


def _rename(side: rec.SideRecords, train: rec.SideRecords) -> dict[str, str]:
    """Rollout keys whose module is another name in training (ALIASES), to that name."""
    train_names = {(plain_name(k) or ("", ""))[0] for k, _ in train.tensors}
    out = {}
    for key, _ in side.tensors:
        pn = plain_name(key)
        if not pn:
            continue
        head, _, last = pn[0].rpartition(".")
        alias = ALIASES.get(last)
        new = f"{head}.{alias}" if alias and head else alias
        if new and pn[0] not in train_names and new in train_names:
            out[key] = key.replace(f"Module.{pn[0]}.", f"Module.{new}.", 1)
    return out


@dataclass
class _Merged:
    values: Array  # [3, positions]
    width: int
    disagree: Array | None = None  # [positions] relative difference of the worst rank
    rank: Array | None = None  # [positions] which rank


def _merge_ranks(rows: dict[int, Array], widths: dict[int, int], want: int, tp_size: int) -> _Merged | str:
    """One rollout tensor's ranks merged against the training width WANT (module doc); a note
    (why it cannot be compared) instead when the widths fit neither way."""
    import numpy as np

    ranks = sorted(rows)
    if len(ranks) == 1 and tp_size == 1:
        r = ranks[0]
        return (
            _Merged(rows[r], widths[r])
            if widths[r] == want
            else f"row widths differ (rollout {widths[r]}, training {want})"
        )
    if len(ranks) == tp_size and sum(widths[r] for r in ranks) == want and len(ranks) > 1:
        stack = np.stack([rows[r] for r in ranks])
        return _Merged(
            np.stack(
                (stack[:, 0].max(axis=0), stack[:, 1].min(axis=0), np.sqrt((stack[:, 2] ** 2).sum(axis=0)))
            ),
            want,
        )
    if all(widths[r] == want for r in ranks):
        base = rows[ranks[0]]
        if len(ranks) == 1:
            return _Merged(base, want)
        diffs = []
        for r in ranks[1:]:
            other = rows[r]
            with np.errstate(invalid="ignore"):
                scale = np.maximum.reduce(
                    [np.abs(base[0]), np.abs(base[1]), np.abs(other[0]), np.abs(other[1])]
                )
                spread = np.maximum(np.abs(base[0] - other[0]), np.abs(base[1] - other[1])) / np.maximum(
                    scale, 1e-30
                )
                norm = np.abs(base[2] - other[2]) / np.maximum(np.maximum(base[2], other[2]), 1e-30)
                diffs.append(np.maximum(spread, norm))
        d = np.stack(diffs)
        worst = np.argmax(np.where(np.isnan(d), -np.inf, d), axis=0)
        return _Merged(base, want, np.take_along_axis(d, worst[None], axis=0)[0], np.array(ranks[1:])[worst])
    shown = ", ".join(f"rank {r}: {widths[r]}" for r in ranks)
    return f"TP row widths ({shown} of {tp_size} rank(s)) give neither the training width {want} nor shards of it"


def _train_width(
    rows: dict[int, Array], widths: dict[int, int], tp_size: int, fulls: set[int] | None
) -> int | str:
    """The whole width of a training tensor recorded on TP_SIZE ranks (Megatron) of WIDTHS each:
    TP_SIZE x its rank width (shards: column-parallel outputs, row-parallel inputs) or its rank width
    (replicated: norms, residuals, all-reduced outputs). The rollout's tensor decides (FULLS: the widths
    it can have whole); where it cannot (a fused pair, both fit), replicated ranks agree and shards do
    not. A note instead when the ranks disagree on the width or some rank has no row."""
    import numpy as np

    if len(rows) != tp_size:
        return f"recorded on rank(s) {sorted(rows)} of {tp_size} only"
    if len(set(widths.values())) != 1:
        return "row widths " + ", ".join(f"rank {r}: {w}" for r, w in sorted(widths.items())) + " differ"
    w = next(iter(widths.values()))
    sharded, replicated = fulls is not None and tp_size * w in fulls, fulls is not None and w in fulls
    if sharded != replicated:
        return tp_size * w if sharded else w
    base = rows[min(rows)]
    with np.errstate(invalid="ignore", divide="ignore"):
        same = all(
            np.nanmax(np.abs(rows[r] - base) / np.maximum(np.abs(base), 1e-30), initial=0.0) <= AGREE
            for r in rows
        )
    return w if same else tp_size * w


def _error(r: Array, t: Array) -> Array:
    """`positions.relative_error` (statistics) at every position: rollout R, training T ([3, n])."""
    import numpy as np

    def ratio(d: Array, s: Array) -> Array:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(s > 0, d / np.where(s > 0, s, 1.0), np.where(d == 0, 0.0, np.inf))

    spread = np.maximum(np.abs(r[0] - t[0]), np.abs(r[1] - t[1]))
    e = np.maximum(
        ratio(spread, np.maximum(np.abs(r[0]), np.abs(r[1]))), ratio(np.abs(r[2] - t[2]), np.abs(r[2]))
    )
    return np.where(np.isnan(r).any(axis=0) | np.isnan(t).any(axis=0), np.nan, e)


def _pad(a: Array, length: int) -> Array:
    import numpy as np

    if a.shape[-1] >= length:
        return a[..., :length]
    pad = np.full((*a.shape[:-1], length - a.shape[-1]), np.nan)
    return np.concatenate((a, pad), axis=-1)


def compare_request(rid: str, rollout: rec.SideRecords, train: rec.SideRecords) -> RequestResult:
    """One request's records judged at every position (module doc)."""
    started = time.monotonic()
    try:
        result = _compare(rid, rollout, train)
    except _NotCompared as exc:
        return RequestResult(rid, None, problem=str(exc), seconds=time.monotonic() - started)
    return RequestResult(rid, None, result, seconds=time.monotonic() - started)


class _NotCompared(Exception):
    pass


def _missing_text(side: str, missing: Sequence[int]) -> str:
    return f"{side} has no record of position(s) {ranges(missing)}"


def _compare(rid: str, rollout: rec.SideRecords, train: rec.SideRecords) -> RecordResult:
    import numpy as np

    rr, tr = rollout.requests[rid], train.requests[rid]
    for side, got in (("rollout", rr), ("training", tr)):
        if got.problems:
            more = f" (and {len(got.problems) - 1} more)" if len(got.problems) > 1 else ""
            raise _NotCompared(f"{side} record: {got.problems[0]}{more}")
    for side, sizes in (("rollout", rr.tp_size), ("training", tr.tp_size)):
        if len(sizes) != 1:
            raise _NotCompared(f"the {side}'s records give several TP sizes ({sorted(sizes)})")
    tp_size, t_tp = next(iter(rr.tp_size)), next(iter(tr.tp_size))
    r_arrays, r_rep = rr.arrays(len(rollout.tensors))
    t_arrays, t_rep = tr.arrays(len(train.tensors))
    absent = [rank for rank in range(t_tp) if rank not in t_arrays]
    if absent:
        raise _NotCompared(
            f"the training's TP rank(s) {absent} of {t_tp} wrote no record of this request (Megatron: every TP "
            "rank of each pipeline stage records its shard)"
        )
    t_all = t_arrays[0]
    t_len = max(a.shape[-1] for a in t_arrays.values())
    r_len = max(a.shape[-1] for a in r_arrays.values())
    problems = []
    # positions: every training position on every TP rank, every rollout position on every TP rank
    for rank in range(t_tp):
        t_has = np.zeros(t_len, bool)
        found = ~np.isnan(t_arrays[rank][:, 2, :]).all(axis=0)
        t_has[: found.size] = found
        if not t_has.all():
            who = "the training side" if t_tp == 1 else f"the training's TP rank {rank}"
            problems.append(_missing_text(who, np.flatnonzero(~t_has).tolist()))
    if r_len > t_len:
        problems.append(_missing_text("the training side", list(range(t_len, r_len))))
    need = max(r_len, t_len - 1)  # the last response token is never fed back to the engine
    for rank in range(tp_size):
        a = r_arrays.get(rank)
        has = np.zeros(need, bool)  # not _pad: its NaN padding would read as True, a position recorded
        if a is not None:
            found = ~np.isnan(a[:, 2, :]).all(axis=0)[:need]
            has[: found.size] = found
        if not has.all():
            who = "the rollout" if tp_size == 1 else f"the rollout's TP rank {rank}"
            problems.append(_missing_text(who, np.flatnonzero(~has).tolist()))
    if problems:
        raise _NotCompared("; ".join(problems) + ": a record cut short, unfinished or not written")
    n = r_len
    r_arrays = {k: _pad(a, n) for k, a in r_arrays.items()}
    t_arrays = {k: _pad(a, n) for k, a in t_arrays.items()}
    t_all = t_arrays[0]
    rename = _rename(rollout, train)
    r_present, t_present = _present(r_arrays), _present(t_arrays)

    def train_whole(i: int) -> int:
        """Training tensor I's whole width for pairing (Megatron TP: shards told from replicas by value)."""
        rows = {rank: a[i] for rank, a in t_arrays.items() if not np.isnan(a[i, 2]).all()}
        width = _train_width(rows, {r: train.widths[i][r] for r in rows}, t_tp, None)
        return width if isinstance(width, int) else train.widths[i][min(train.widths[i])]

    r_view = _view(rollout, r_arrays, r_present, rename, rollout.folder)
    t_view = _view(train, {0: t_all}, t_present, {}, train.folder, train_whole if t_tp > 1 else None)
    r_index = {(rename.get(k, k), lab): i for i, (k, lab) in enumerate(rollout.tensors)}
    t_index = {k: i for i, k in enumerate(train.tensors)}

    def rollout_value(key: str, label: str, want: int) -> _Merged | str:
        i = r_index[(key, label)]
        if i in rollout.odd_widths:
            return rollout.odd_widths[i]
        rows = {rank: a[i] for rank, a in r_arrays.items() if not np.isnan(a[i, 2]).all()}
        return _merge_ranks(rows, {r: rollout.widths[i][r] for r in rows}, want, tp_size)

    def train_part(i: int, fulls: set[int] | None) -> _Merged | str:
        """Training tensor I over its TP ranks (Megatron): shards merged, replicated ranks checked."""
        if t_tp == 1:
            return _Merged(t_all[i], train.widths[i][0])
        rows = {rank: a[i] for rank, a in t_arrays.items() if not np.isnan(a[i, 2]).all()}
        widths = {r: train.widths[i][r] for r in rows}
        want = _train_width(rows, widths, t_tp, fulls)
        return want if isinstance(want, str) else _merge_ranks(rows, widths, want, t_tp)

    def train_value(keys: tuple[str, ...], label: str, fulls: set[int] | None) -> _Merged | str:
        parts = [t_index[(k, label)] for k in keys if (k, label) in t_index]
        if len(parts) != len(keys):
            return "only on one side"
        odd = next((train.odd_widths[i] for i in parts if i in train.odd_widths), None)
        if odd:
            return odd
        merged = [train_part(i, fulls if len(parts) == 1 else None) for i in parts]
        note = next((m for m in merged if isinstance(m, str)), None)
        if note is not None:
            return f"the training's TP ranks: {note}"
        done = [m for m in merged if not isinstance(m, str)]
        disagree = next((m for m in done if m.disagree is not None), None)
        if len(done) == 1:
            return done[0]
        stack = np.stack([m.values for m in done])
        values = np.stack(
            (stack[:, 0].max(axis=0), stack[:, 1].min(axis=0), np.sqrt((stack[:, 2] ** 2).sum(axis=0)))
        )
        width = sum(m.width for m in done)
        return _Merged(values, width, *((disagree.disagree, disagree.rank) if disagree else ()))

    def rollout_fulls(key: str, label: str) -> set[int]:
        """The rollout tensor's whole width: its ranks' sum where vLLM's module shards it (`shard_dim`:
        column-parallel outputs, row-parallel inputs), else its ranks' one width."""
        widths = rollout.widths[r_index[(key, label)]]
        role, _, n = label.partition(".")
        cls = (plain_name(key) or ("", ""))[1]
        sharded = shard_dim(cls, "output" if role == "output" else "input_args", int(n or 0), 2) is not None
        return {sum(widths.values())} if sharded and tp_size > 1 else set(widths.values())

    # the token ids first: another sequence is NOT COMPARED
    ids, tids = ids_leaf(r_view, t_view), ids_leaf(t_view, r_view)
    if ids is None or tids is None:
        raise _NotCompared("no integer input (token ids) recorded on both sides: record the embedding module")
    tv = train_value((tids[0],), tids[1], {1})
    rv = rollout_value(ids[0], ids[1], tv.width if not isinstance(tv, str) else 1)
    if isinstance(tv, str) or isinstance(rv, str):
        raise _NotCompared(
            f"the token ids cannot be read on both sides ({tv if isinstance(tv, str) else rv})"
        )
    differ = np.flatnonzero(
        (rv.values[0] != tv.values[0])
        | (rv.values[1] != tv.values[1])
        | ((rv.disagree if rv.disagree is not None else 0) > 0)
        | ((tv.disagree if tv.disagree is not None else 0) > 0)
    )
    if differ.size:
        p = int(differ[0])
        lost = [
            side for side, v in (("rollout", rv.values[0][p]), ("training", tv.values[0][p])) if np.isnan(v)
        ]
        if lost:
            raise _NotCompared(
                f"the token ids are not recorded at position {p} on the {' and '.join(lost)} side"
            )
        raise _NotCompared(
            f"the token ids differ at position {p} (rollout {rv.values[0][p]:g}, training {tv.values[0][p]:g}): "
            "the rollout and the training forward (or two of its TP ranks) did not see one sequence"
        )
    plan = pairings(r_view, t_view)
    result = RecordResult(
        prompt=min(rr.prompt, n), train_tokens=t_len, uncovered=list(range(n, t_len)), repeated=r_rep + t_rep
    )
    result.phases = ["prefill" if p < result.prompt else "decode" for p in range(n)]
    errors: dict[int, Array] = {}
    dtypes: dict[int, tuple[str, str]] = {}
    notes: dict[int, str] = {}
    tp_cells: dict[
        int, tuple[Array, Array, str]
    ] = {}  # a replicated tensor whose TP ranks differ: which side
    for pair in plan:
        if pair.note:
            notes[pair.index] = pair.note
            continue
        t = train_value(pair.train_keys, pair.label, rollout_fulls(pair.rollout_key, pair.label))
        if isinstance(t, str):
            notes[pair.index] = t
            continue
        r = rollout_value(pair.rollout_key, pair.label, t.width)
        if isinstance(r, str):
            notes[pair.index] = r
            continue
        r_dtype = rollout.dtypes[r_index[(pair.rollout_key, pair.label)]]
        t_dtype = train.dtypes[t_index[(pair.train_keys[0], pair.label)]]
        dtypes[pair.index] = (t_dtype, r_dtype)
        found = [
            (m.disagree, m.rank, side)
            for m, side in ((r, ""), (t, "the training's "))
            if m.disagree is not None and m.rank is not None
        ]
        if found:  # the side whose ranks differ most (the rollout's on a tie)
            tp_cells[pair.index] = max(found, key=lambda cell: float(np.nanmax(cell[0], initial=0.0)))
        if not is_integer(r_dtype):
            errors[pair.index] = _error(r.values, t.values)
    for why in notes.values():
        result.not_judged[why] = result.not_judged.get(why, 0) + 1
    rows = [
        own_row(
            p.index,
            f"{p.rollout_key}.{p.label}",
            f"{p.train_keys[0]}.{p.label}" if p.index in dtypes else "",
            None,
            comparable=p.index in dtypes,
            note=notes.get(p.index, ""),
            dtypes=dtypes.get(p.index, ("", "")),
        )
        for p in plan
    ]
    judged_rows = apply_engine_conventions(rows)
    for row in judged_rows:
        if row.note and row.index in dtypes and row.index not in notes:
            result.not_judged[row.note] = result.not_judged.get(row.note, 0) + 1
    _judge(result, plan, judged_rows, errors, tp_cells, n)
    _coverage(result, plan, train, t_present)
    return result


def _judge(
    result: RecordResult,
    plan: list[Pairing],
    rows: list[Any],
    errors: dict[int, Array],
    tp_cells: dict[int, tuple[Array, Array, str]],
    n: int,
) -> None:
    import numpy as np

    order: list[str] = []
    groups: dict[str, list[int]] = {}
    for row in rows:
        if row.module not in groups:
            order.append(row.module)
        groups.setdefault(row.module, []).append(row.index)
    by_index = {row.index: row for row in rows}
    spec = []
    outs_of: list[list[tuple[int, str, str]]] = []
    for module in order:
        ins, outs, named = [], [], []
        for i in groups[module]:
            row = by_index[i]
            if not row.comparable or i not in errors:
                continue
            if row.tensor.startswith("output"):
                precision = precision_of(row.train_dtype, row.rollout_dtype)
                outs.append((errors[i], NOISE_FLOOR.get(precision, NOISE_FLOOR["fp32"])))
                named.append((i, row.tensor, precision))
            else:
                ins.append(errors[i])
        # a replicated tensor that differs between TP ranks is a finding of its module even unjudged
        if not outs and any(i in tp_cells for i in groups[module]):
            outs.append((np.full(n, np.nan), NOISE_FLOOR["fp32"]))
            named.append((groups[module][0], by_index[groups[module][0]].tensor, "fp32"))
        spec.append((module, ins, outs))
        outs_of.append(named)
    judged = judge_arrays(spec, n)
    for m, (module, jm) in enumerate(zip(order, judged)):
        if jm is None:
            continue
        layer = by_index[groups[module][0]].layer
        at = len(result.modules)
        for i in groups[module]:
            if i not in tp_cells:
                continue
            diff, rank, side = tp_cells[i]
            bad = np.flatnonzero(diff > AGREE)
            if bad.size == 0:
                continue
            measured, divergent, error = (
                np.array(x, copy=True) for x in (jm.measured, jm.divergent, jm.error)
            )
            for p in bad.tolist():
                label = by_index[i].tensor
                result.tp[(at, p)] = (
                    f"{label} on {side}TP rank {int(rank[p])} (a replicated tensor: differs from TP rank 0 by "
                    f"{diff[p]:.3g})",
                    float(diff[p]),
                )
                if not measured[p]:
                    error[p] = diff[p]
                measured[p], divergent[p] = True, True
            jm = JudgedModule(jm.module, measured, jm.worst, error, jm.received, jm.floor, divergent)
        result.modules.append((module, layer, jm, outs_of[m]))


def _coverage(
    result: RecordResult, plan: list[Pairing], train: rec.SideRecords, t_present: list[int]
) -> None:
    """The smaller share of either side's modules (with an output) judged at some position."""
    import numpy as np

    outputs = {module_of(f"{p.rollout_key}.{p.label}")[0] for p in plan if p.label.startswith("output")}
    judged = {name for name, _, jm, _ in result.modules if np.asarray(jm.measured).any()}
    used = {k for p in plan if module_of(f"{p.rollout_key}.{p.label}")[0] in judged for k in p.train_keys}
    train_outputs = {train.tensors[i][0] for i in t_present if train.tensors[i][1] == "output.0"}
    result.coverage = min(
        len(judged & outputs) / len(outputs) if outputs else 0.0,
        len(used & train_outputs) / len(train_outputs) if train_outputs else 0.0,
    )


# ------------------------------------------------------------------ the job
@dataclass(frozen=True)
class RecordJob:
    """Every recorded request compared, and what was read."""

    results: tuple[RequestResult, ...]
    only: dict[str, tuple[str, ...]]  # side -> request ids recorded there only
    sizes: dict[str, int]  # side -> bytes of its records
    records: dict[str, int]  # side -> finished records read
    unfinished: dict[str, int]  # side -> records without their header (skipped)
    repeated: int
    folders: dict[str, str]

    def to_json(self) -> dict[str, object]:
        return {
            "folders": self.folders,
            "records": self.records,
            "unfinished": self.unfinished,
            "only_on": {k: list(v) for k, v in self.only.items()},
            "repeated_rows": self.repeated,
        }

    def notes(self) -> list[str]:
        out = []
        for side, ids in self.only.items():
            if ids:
                shown = ", ".join(ids[:5]) + (f" (and {len(ids) - 5} more)" if len(ids) > 5 else "")
                out.append(f"recorded on the {side} side only (not compared): {shown}")
        for side, k in self.unfinished.items():
            if k:
                out.append(
                    f"{k} unfinished {side} record(s) (no header: the process stopped while writing) skipped"
                )
        if self.repeated:
            out.append(f"{self.repeated} row(s) recorded twice (a recomputed forward): the first kept")
        return out


def compare_job(folders: dict[str, Path], requests: set[str] | None = None) -> RecordJob:
    """Both sides' records under FOLDERS ({"rollout": .., "train": ..}) compared per request
    (REQUESTS: only these base ids)."""
    missing = [s for s in rec.SIDES if s not in folders]
    if missing:
        where = ", ".join(str(p) for p in folders.values())
        raise UserError(
            f"{where}: records of the {' and '.join(missing)} side are missing (DIR/{missing[0]}/{{pid}}/rec*.json); "
            "pass the records root (RL_MSPROBE_RECORD_DIR) or both side folders."
        )
    rollout = rec.read_side("rollout", folders["rollout"])
    train = rec.read_side("train", folders["train"])
    both = [r for r in rollout.requests if r in train.requests]
    if requests is not None:
        both = [r for r in both if r in requests]
        if not both:
            raise UserError(f"no request {', '.join(sorted(requests))} recorded on both sides.")
    only = {
        "rollout": tuple(
            r for r in rollout.requests if r not in train.requests and (requests is None or r in requests)
        ),
        "train": tuple(
            r for r in train.requests if r not in rollout.requests and (requests is None or r in requests)
        ),
    }
    results = []
    for rid in both:
        results.append(compare_request(rid, rollout, train))
        rollout.requests[rid].chunks.clear()  # one request's arrays at a time
        train.requests[rid].chunks.clear()
    repeated = sum(r.result.repeated for r in results if isinstance(r.result, RecordResult))
    return RecordJob(
        tuple(results),
        only,
        {"rollout": rollout.bytes, "train": train.bytes},
        {"rollout": rollout.records, "train": train.records},
        {"rollout": rollout.unfinished, "train": train.unfinished},
        repeated,
        {k: str(v) for k, v in folders.items()},
    )

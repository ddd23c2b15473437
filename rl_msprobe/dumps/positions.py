"""Whole-response consistency: every position of a request compared, module by module.

The rollout engine runs a request as one prefill forward (rows 0..P-1) and one decode forward
per generated token (decode step k: one row, position P+k); the trainer runs one forward over
prompt + response. msprobe compares two dumps of one forward; here each rollout step is
compared with the rows of the training forward at the same positions (docs/whole-response.md):

- the training side gives rows: the per-token record of the verl engine hook
  (`DUMP_POSITIONS=1`: each token's Max, Min and norm, summed over a span as needed) or a
  tensor-mode dump (its rows are cut out of the `.pt` files); a rollout step in tensor mode is compared row by row (one position per row), one in statistics
  mode as a whole (a decode step's statistics are its one position's; a prefill in statistics
  mode gives one span, positions 0..P-1, not resolved further);
- modules are paired by name (FSDP wrappers and class dropped) and tensor (`output.0`, ...); a
  rollout fused module (qkv, gate/up) is met by the training parts `fused` finds, their rows
  concatenated; tensors that are other quantities by engine convention (`summary`) are not
  judged; a rollout step of several TP ranks is merged first (`inputs.merged_rollout`);
- the token ids (the first integer input found on both sides: the embedding's) must agree at
  every position, else the request is NOT COMPARED, naming the first position that differs;
- each position's rows go through rl-msprobe's own rule (`judge`: output error beyond the
  input's and the dtype noise floor); the first divergence is the earliest position with a
  divergent module, and the first such module there.

Errors are computed as the judge module doc says msprobe's columns give them (tensor:
max |a-b| / max |a| and ||a-b|| / ||a||; statistics: the Max/Min and norm differences), the
rollout being the reference (msprobe's Bench side).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.dumps import tensor_jobs
from rl_msprobe.dumps.fused import parts_of
from rl_msprobe.dumps.judge import Judgement, is_integer, judge
from rl_msprobe.dumps.layout import load_json
from rl_msprobe.dumps.summary import apply_engine_conventions, module_of, own_row
from rl_msprobe.dumps.tp_merge import COLUMN, is_tensor
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

TENSOR_DIR = "dump_tensor_data"
PER_TOKEN = "per_token"  # a training record of per-token statistics (verl engine hook, DUMP_POSITIONS=1)
MIN_COVERAGE = 0.5  # as dumps compare: below this share of the rollout's modules judged, NOT COMPARED
_KEY = re.compile(r"^Module\.(?P<name>.+)\.(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.forward\.(?P<n>\d+)$")
WRAP = "_fsdp_wrapped_module."
Array = Any  # numpy arrays (numpy is imported where used)


@dataclass(frozen=True)
class Forward:
    """One forward's dump: its module entries (forward order), task and tensor folder."""

    path: Path
    task: str
    data: JsonObject

    @property
    def folder(self) -> Path:
        return self.path.parent / TENSOR_DIR


def read_forward(path: Path) -> Forward:
    doc = load_json(path)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(data, dict):
        raise UserError(f"{path}: not an msprobe dump.json (no `data` object).")
    modules = {k: v for k, v in data.items() if k.startswith("Module.") and isinstance(v, dict)}
    if not modules:
        raise UserError(f"{path}: no module (L0 / mix) rows; dump with level L0 or mix.")
    return Forward(path, str(doc.get("task") or "statistics"), modules)


def plain_name(key: str) -> tuple[str, str] | None:
    """(module name without FSDP wrappers, class) of a module key."""
    m = _KEY.match(key.replace(WRAP, ""))
    return (m.group("name"), m.group("cls")) if m else None


def _leaves(entry: JsonObject) -> list[tuple[str, JsonObject]]:
    """(label, leaf) of an entry's tensors: input.N, output.N (parameters are not per position)."""
    out = []
    for role, label in (("input_args", "input"), ("output", "output")):
        items = entry.get(role)
        if isinstance(items, list):
            out += [(f"{label}.{i}", leaf) for i, leaf in enumerate(items) if is_tensor(leaf)]
    return out


def _leaf(entry: JsonObject, label: str) -> JsonObject | None:
    return dict(_leaves(entry)).get(label)


# ------------------------------------------------------------------ per-position values
@dataclass(frozen=True)
class Value:
    """One side's value at a span of positions: a flat row (tensor mode) or msprobe statistics."""

    dtype: str
    row: Array | None = None
    stats: tuple[float, float, float] | None = None  # Max, Min, Norm

    def statistics(self) -> tuple[float, float, float] | None:
        if self.stats is not None:
            return self.stats
        if self.row is None or self.row.size == 0:
            return None
        import numpy as np

        r = self.row.astype(np.float64)
        return float(r.max()), float(r.min()), float(np.linalg.norm(r))


def _ratio(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def relative_error(rollout: Value, train: Value) -> float | None:
    """The judge's relative error with the rollout as reference (module doc)."""
    import numpy as np

    if rollout.row is not None and train.row is not None:
        a, b = rollout.row.astype(np.float64), train.row.astype(np.float64)
        if a.shape != b.shape or a.size == 0:
            return None
        d = np.abs(a - b)
        return max(
            _ratio(float(d.max()), float(np.abs(a).max())),
            _ratio(float(np.linalg.norm(d)), float(np.linalg.norm(a))),
        )
    r, t = rollout.statistics(), train.statistics()
    if r is None or t is None:
        return None
    spread = max(abs(r[0] - t[0]), abs(r[1] - t[1]))
    return max(_ratio(spread, max(abs(r[0]), abs(r[1]))), _ratio(abs(r[2] - t[2]), abs(r[2])))


def same_ids(rollout: Value, train: Value) -> bool:
    """Integer inputs (token ids) equal: element by element, or by Max/Min in statistics mode."""
    if rollout.row is not None and train.row is not None:
        return bool(rollout.row.shape == train.row.shape and (rollout.row == train.row).all())
    r, t = rollout.statistics(), train.statistics()
    return r is not None and t is not None and r[:2] == t[:2]


def ids_text(v: Value) -> str:
    if v.row is not None:
        return " ".join(str(int(x)) for x in v.row.ravel()[:8])
    return f"max {v.stats[0]:g} min {v.stats[1]:g}" if v.stats else "?"


def token_rows(a: Array, tokens: int) -> Array | None:
    """A tensor as [tokens, rest]: its first axis of that size is the token axis (a one-token
    forward: the whole tensor is the row); None when no axis has that size."""
    import numpy as np

    if tokens == 1:
        return a.reshape(1, -1)
    axis = next((i for i, n in enumerate(a.shape) if n == tokens), None)
    return None if axis is None else np.moveaxis(a, axis, 0).reshape(tokens, -1)


# ------------------------------------------------------------------ the request's steps
@dataclass(frozen=True)
class Step:
    """One rollout forward of the request: its dump (TP ranks merged), first position, phase."""

    forward: Forward
    start: int
    tokens: int
    phase: str  # prefill | decode

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Positions compared as one: each row in tensor mode; the whole step in statistics mode."""
        if self.forward.task == "tensor":
            return [(self.start + i, self.start + i + 1) for i in range(self.tokens)]
        return [(self.start, self.start + self.tokens)]


def ids_leaf(fwd: Forward, other: Forward) -> tuple[str, str] | None:
    """(key in FWD, label) of the first integer input that OTHER has under the same module name."""
    names = {plain_name(k): k for k in other.data}
    by_name = {n[0]: k for n, k in names.items() if n}
    for key, entry in fwd.data.items():
        pn = plain_name(key)
        if not pn or pn[0] not in by_name:
            continue
        for label, leaf in _leaves(entry):
            theirs = _leaf(other.data[by_name[pn[0]]], label)
            if (
                label.startswith("input")
                and theirs is not None
                and is_integer(str(leaf.get("dtype")), str(theirs.get("dtype")))
            ):
                return key, label
    return None


def _count(leaf: JsonObject) -> int:
    return math.prod(int(x) for x in leaf.get("shape") or []) if leaf.get("shape") else 1


# ------------------------------------------------------------------ pairing tensors
@dataclass(frozen=True)
class Pairing:
    """A rollout tensor and what it is compared with in the training forward."""

    index: int  # forward order
    rollout_key: str
    label: str
    train_keys: tuple[str, ...]  # one, or the parts of a fused module (rows concatenated)
    note: str = ""  # why it is not judged ('' when it is)


def pairings(first: Forward, train: Forward) -> list[Pairing]:
    """Every tensor of the rollout's first step, in forward order, with its training counterpart."""
    by_name: dict[str, str] = {}
    for key in train.data:
        pn = plain_name(key)
        if pn and key.replace(WRAP, "").endswith(".forward.0"):
            by_name.setdefault(pn[0], key)
    out: list[Pairing] = []
    for key, entry in first.data.items():
        pn = plain_name(key)
        if not pn:
            continue
        name, cls = pn
        for label, leaf in _leaves(entry):
            tkeys: tuple[str, ...] = ()
            note = ""
            if name in by_name and _leaf(train.data[by_name[name]], label) is not None:
                tkeys = (by_name[name],)
                tcls = (plain_name(by_name[name]) or ("", ""))[1]
                if cls == "SiluAndMul" and tcls != "SiluAndMul":
                    note = "vLLM SiluAndMul returns silu(gate)*up, the training act_fn silu(gate)"
                theirs = _leaf(train.data[by_name[name]], label)
                if theirs is not None and is_integer(str(leaf.get("dtype"))) != is_integer(
                    str(theirs.get("dtype"))
                ):
                    note = "other quantities (integer on one side only: argument layouts differ)"
            elif cls in COLUMN and label in ("input.0", "output.0") and _leaf(entry, "output.0"):
                width = int((_leaf(entry, "output.0") or {}).get("shape", [0])[-1])
                parts = tuple(k for _, k, _ in parts_of(train.data, name, width))
                tkeys = parts if label == "output.0" else parts[:1]  # the parts share one input
            if not tkeys:
                note = "only on one side"
            out.append(Pairing(len(out), key, label, tkeys, note))
    return out


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class Position:
    """One span of positions (one position, or a prefill in statistics mode) judged."""

    start: int
    stop: int
    phase: str
    judgements: tuple[Judgement, ...]

    @property
    def first(self) -> Judgement | None:
        return next((j for j in self.judgements if j.divergent), None)

    def label(self, prompt: int) -> str:
        if self.stop - self.start > 1:
            return f"positions {self.start}-{self.stop - 1} (prefill, statistics)"
        p = self.start
        return f"position {p} (prompt)" if p < prompt else f"position {p} (response position {p - prompt})"

    def to_json(self) -> dict[str, object]:
        first = self.first
        return {
            "start": self.start,
            "stop": self.stop,
            "phase": self.phase,
            "divergent": first is not None,
            "first": first.to_json() if first else None,
            "judged": len(self.judgements),
            "worst_error": max((j.error for j in self.judgements), default=None),
        }


@dataclass
class Result:
    prompt: int  # P: prefill rows
    train_tokens: int  # prompt + response, the training forward's rows
    positions: Sequence[Position] = field(default_factory=list)
    ids_mismatch: str | None = None  # NOT COMPARED: why (first differing position)
    not_judged: dict[str, int] = field(default_factory=dict)  # note -> tensors
    uncovered: list[int] = field(default_factory=list)  # training positions no rollout step has
    coverage: float = 1.0  # the smaller share of either side's modules (with an output) judged somewhere

    def spans(self) -> list[tuple[int, int, str]]:
        """(start, stop, phase) of each position span, in order."""
        return [(p.start, p.stop, p.phase) for p in self.positions]

    def summaries(self) -> list[tuple[Position, Judgement | None, Judgement | None, int, float | None]]:
        """Per span: (the span, its first divergent module, the module of the largest error / floor,
        modules judged, the largest error)."""
        return [
            (
                p,
                p.first,
                max(p.judgements, key=lambda j: j.floor_ratio, default=None),
                len(p.judgements),
                max((j.error for j in p.judgements), default=None),
            )
            for p in self.positions
        ]

    def divergent_spans(self) -> int:
        """How many position spans hold a divergent module."""
        return sum(1 for q in self.positions if q.first)

    def judged(self) -> tuple[int, dict[str, float]]:
        """(module outputs judged over every span, noise floor by precision)."""
        return (
            sum(len(p.judgements) for p in self.positions),
            {j.precision: j.floor for p in self.positions for j in p.judgements},
        )

    @property
    def first(self) -> tuple[Position, Judgement] | None:
        for p in self.positions:
            j = p.first
            if j is not None:
                return p, j
        return None

    @property
    def unjudged(self) -> list[int]:
        """First positions of the spans where no module output could be judged."""
        return [p.start for p in self.positions if not p.judgements]

    @property
    def status(self) -> str:
        """divergent | not compared (other token ids, or a position nothing was judged at) | consistent."""
        if self.ids_mismatch:
            return "not compared"
        if self.first:
            return "divergent"
        if not self.positions or self.unjudged or self.coverage < MIN_COVERAGE:
            return "not compared"
        return "consistent"

    def verdict(self) -> str:
        if self.ids_mismatch:
            return f"NOT COMPARED: {self.ids_mismatch}"
        first = self.first
        n = len(self.positions)
        if first is not None:
            p, j = first
            bad = self.divergent_spans()
            return (
                f"DIVERGENT: first divergence at {p.label(self.prompt)}, {p.phase}, in {j.module} {j.tensor} "
                f"(layer {'–' if j.layer is None else j.layer}): error {j.error:.3g}, {j.floor_ratio:.3g}x the "
                f"{j.precision} noise floor, {j.gain:.3g}x what it received; {bad} of {n} position span(s) diverge"
            )
        if self.status == "not compared" and self.positions and not self.unjudged:
            return (
                f"NOT COMPARED: only {self.coverage:.0%} of one side's modules met the other's "
                f"(< {MIN_COVERAGE:.0%}; other names, other module selections, or a dump cut short?)"
            )
        if self.status == "not compared":
            where = ", ".join(map(str, self.unjudged[:10])) or "any position"
            return f"NOT COMPARED: no module output could be judged at {where} (do both sides dump the same modules?)"
        judged, by_precision = self.judged()
        floors = ", ".join(f"{k} {100 * v:.3g}%" for k, v in sorted(by_precision.items()))
        # the last response token is never fed back: its position has no rollout step by design
        missing = self.uncovered[:-1]
        gap = (
            f"; training positions {missing[0]}-{self.uncovered[-1]} have no rollout step (not compared)"
            if missing
            else ""
        )
        return (
            f"CONSISTENT at every {'compared ' if missing else ''}position: {n} position span(s) (prompt "
            f"{self.prompt}, response {self.train_tokens - self.prompt}), {judged} module outputs judged; none "
            f"exceeds its input's error and the noise floor ({floors}){gap}"
        )

    def layer_map(self) -> tuple[list[str], list[list[float | None]]]:
        """(layer labels: embed, 0.., head; [position span][layer] largest error / noise floor)."""
        layers: list[str] = []
        for p in self.positions:
            for lab in _layer_labels(p.judgements):
                if lab not in layers:
                    layers.append(lab)
        ordered = sorted(layers, key=lambda s: -1 if s == "embed" else (10**9 if s == "head" else int(s)))
        grid: list[list[float | None]] = []
        for p in self.positions:
            row: list[float | None] = [None] * len(ordered)
            for lab, j in zip(_layer_labels(p.judgements), p.judgements):
                i = ordered.index(lab)
                row[i] = max(row[i] or 0.0, j.floor_ratio)
            grid.append(row)
        return ordered, grid

    def to_json(self) -> dict[str, object]:
        first = self.first
        return {
            "status": self.status,
            "verdict": self.verdict(),
            "prompt": self.prompt,
            "train_tokens": self.train_tokens,
            "first": {"start": first[0].start, "phase": first[0].phase, **first[1].to_json()}
            if first
            else None,
            "ids_mismatch": self.ids_mismatch,
            "uncovered": self.uncovered,
            "coverage": round(self.coverage, 4),
            "not_judged": self.not_judged,
            "unjudged": self.unjudged,
            "positions": [
                {
                    "start": p.start,
                    "stop": p.stop,
                    "phase": p.phase,
                    "divergent": first is not None,
                    "first": first.to_json() if first else None,
                    "judged": judged,
                    "worst_error": worst_error,
                }
                for p, first, _, judged, worst_error in self.summaries()
            ],
        }


def _layer_labels(judgements: Sequence[Judgement]) -> list[str]:
    seen_layer = False
    out = []
    for j in judgements:
        if j.layer is not None:
            seen_layer = True
            out.append(str(j.layer))
        else:
            out.append("head" if seen_layer else "embed")
    return out


# ------------------------------------------------------------------ the comparison
Loader = Callable[[list[Path]], dict[Path, Array]]


def load_arrays(python: list[str] | None = None) -> Loader:
    """Tensor files -> numpy arrays: with torch here, else through the training interpreter."""

    def load(files: list[Path]) -> dict[Path, Array]:
        import numpy as np

        from rl_msprobe import bounded

        for f in files:  # torch.load would block on a FIFO or read a device without end
            bounded.regular(f, "msprobe tensor file (.pt)")
        if tensor_jobs.here(python):
            import torch

            out = {}
            for f in files:
                t = torch.load(f, map_location="cpu", weights_only=True).detach()
                out[f] = t.to(torch.float32 if t.is_floating_point() else torch.int64).numpy()
            return out
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rl-msprobe-npy-") as tmp:
            jobs: list[JsonObject] = [{"src": str(f), "dst": f"{tmp}/{i}.npy"} for i, f in enumerate(files)]
            tensor_jobs.run("npy", jobs, python)
            return {f: np.load(f"{tmp}/{i}.npy") for i, f in enumerate(files)}

    return load


def _file(fwd: Forward, leaf: JsonObject) -> Path | None:
    name = leaf.get("data_name")
    return fwd.folder / name if isinstance(name, str) and fwd.task == "tensor" else None


def span_statistics(leaf: JsonObject, start: int, stop: int) -> tuple[float, float, float] | None:
    """Max, Min and L2 norm of rows START..STOP-1 of a per-token leaf (`per_token` lists, one
    value per token, as the verl engine hook records them with DUMP_POSITIONS=1)."""
    per = leaf.get("per_token")
    if not isinstance(per, dict):
        return None
    cols = [per.get(k) for k in ("Max", "Min", "Norm")]
    if not all(isinstance(c, list) and len(c) >= stop for c in cols) or start >= stop or start < 0:
        return None
    hi, lo, norm = (c[start:stop] for c in cols)  # type: ignore[index]
    try:
        return float(max(hi)), float(min(lo)), math.sqrt(sum(float(x) ** 2 for x in norm))
    except (TypeError, ValueError):
        return None


def _stats_value(leaf: JsonObject) -> Value:
    """A statistics-mode leaf's Max, Min, Norm (integers: Max and Min; Norm 0)."""
    dtype = str(leaf.get("dtype"))
    vals = [v if isinstance(v := leaf.get(k), (int, float)) else None for k in ("Max", "Min", "Norm")]
    if is_integer(dtype) and vals[2] is None:
        vals[2] = 0.0
    hi, lo, norm = vals
    if hi is None or lo is None or norm is None:
        return Value(dtype)
    return Value(dtype, stats=(float(hi), float(lo), float(norm)))


class _Side:
    """Reads one forward's tensors as [tokens, rest] rows (cached until `drop`)."""

    def __init__(self, fwd: Forward, tokens: int, load: Loader):
        self.fwd, self.tokens, self.load = fwd, tokens, load
        self.cache: dict[Path, Array | None] = {}

    def wanted(self, keys: tuple[str, ...], label: str) -> list[Path]:
        """The tensor files of KEYS' LABEL not read yet (each checked to exist)."""
        out = []
        for key in keys:
            entry = self.fwd.data.get(key)
            leaf = _leaf(entry, label) if entry else None
            f = _file(self.fwd, leaf) if leaf else None
            if f is not None and f not in self.cache:
                if not f.is_file():
                    raise UserError(
                        f"{f}: tensor file named in {self.fwd.path} is missing; re-dump this step."
                    )
                out.append(f)
        return out

    def rows(self, key: str, label: str) -> tuple[JsonObject | None, Array | None]:
        entry = self.fwd.data.get(key)
        leaf = _leaf(entry, label) if entry else None
        if leaf is None:
            return None, None
        f = _file(self.fwd, leaf)
        if f is None:
            return leaf, None
        if f not in self.cache:
            self.fill(self.load(self.wanted((key,), label)))
        return leaf, self.cache.get(f)

    def fill(self, arrays: dict[Path, Array]) -> None:
        for f, a in arrays.items():
            if f.parent == self.fwd.folder:
                self.cache[f] = token_rows(a, self.tokens)

    def value(self, keys: tuple[str, ...], label: str, span: tuple[int, int], offset: int) -> Value | None:
        """The value at SPAN (absolute positions; OFFSET: this forward's first position); several
        KEYS (fused parts): their rows side by side."""
        import numpy as np

        rows, dtype = [], ""
        spans: list[tuple[float, float, float]] = []
        for key in keys:
            leaf, r = self.rows(key, label)
            if leaf is None:
                return None
            dtype = str(leaf.get("dtype"))
            if self.fwd.task == PER_TOKEN:
                stats = span_statistics(leaf, span[0] - offset, span[1] - offset)
                if stats is None:
                    return None
                spans.append(stats)
                continue
            if r is None:
                if len(keys) == 1 and span[1] - span[0] == self.tokens:
                    return _stats_value(leaf)  # statistics mode: the whole forward is the span
                return None
            rows.append(r[span[0] - offset : span[1] - offset])
        if spans:  # fused parts side by side: the statistics of their concatenation
            hi, lo = max(x[0] for x in spans), min(x[1] for x in spans)
            return Value(dtype, stats=(hi, lo, math.sqrt(sum(x[2] ** 2 for x in spans))))
        block = np.concatenate(rows, axis=-1) if len(rows) > 1 else rows[0]
        return Value(dtype, row=block.reshape(-1)) if block.shape[0] == span[1] - span[0] else None

    def drop(self) -> None:
        self.cache.clear()


def _tokens(fwd: Forward, key: str, label: str) -> int:
    leaf = _leaf(fwd.data[key], label)
    return _count(leaf) if leaf else 0


def token_count(fwd: Forward, other: Forward | None = None) -> int:
    """How many tokens FWD's forward ran: its token-id input's size (the first integer input
    OTHER has too; OTHER defaults to FWD)."""
    ids = ids_leaf(fwd, other or fwd)
    if ids is None:
        raise UserError(
            f"{fwd.path}: no integer input (token ids) in the dump; include the embedding module."
        )
    return _tokens(fwd, *ids)


def read_step(ranks: Sequence[Path], train: Forward, dest: Path, python: list[str] | None = None) -> Forward:
    """One rollout step from the dump.json of each of its TP ranks (lowest first): merged under
    DEST when there are several (inputs.merged_rollout, the training forward's token count
    told, so that shards found by shape are found in a step of fewer tokens)."""
    from rl_msprobe.dumps.inputs import merged_rollout

    first = read_forward(ranks[0])
    if len(ranks) == 1:
        return first
    tokens = (token_count(train, first), token_count(first, train))
    path, _ = merged_rollout(list(ranks), train.path, dest, python, tokens)
    return read_forward(path)


def steps_of(prefill: Forward, decodes: Sequence[Forward]) -> tuple[list[Step], tuple[str, str]]:
    """The request's steps with their positions, and where the token ids are (prefill key, label)."""
    ids = ids_leaf(prefill, prefill)
    if ids is None:
        raise UserError(
            f"{prefill.path}: no integer input (token ids) in the dump; include the embedding module."
        )
    p = _tokens(prefill, *ids)
    steps = [Step(prefill, 0, p, "prefill")]
    for k, d in enumerate(decodes):
        if ids[0] not in d.data:
            raise UserError(
                f"{d.path}: decode step {k} has no {ids[0]}; dump every step with the same modules."
            )
        steps.append(Step(d, p + k, _tokens(d, *ids), "decode"))
    return steps, ids


def compare_request(
    prefill: Forward,
    decodes: Sequence[Forward],
    train: Forward,
    load: Loader | None = None,
) -> Result:
    """Judge every position of one request (module doc). PREFILL / DECODES: the rollout's steps
    (TP ranks already merged), TRAIN: the training forward over prompt + response."""
    if train.task not in ("tensor", PER_TOKEN):
        raise UserError(
            f"{train.path}: the training dump is in {train.task} mode; per-position comparison needs rows: "
            "the per-token record of the verl engine hook (DUMP_POSITIONS=1, written by `prepare --mode "
            "consistency`) or a tensor-mode dump (docs/whole-response.md)."
        )
    load = load or load_arrays()
    steps, ids = steps_of(prefill, decodes)
    train_ids = ids_leaf(train, prefill)
    if train_ids is None:
        raise UserError(
            f"{train.path}: no token-id input matching the rollout's {ids[0]}; include the embedding."
        )
    t_tokens = _tokens(train, *train_ids)
    result = Result(prompt=steps[0].tokens, train_tokens=t_tokens)
    covered = steps[-1].start + steps[-1].tokens
    if covered > t_tokens:
        raise UserError(
            f"{train.path}: the training forward has {t_tokens} tokens, the rollout steps cover {covered}; "
            "pair the request's steps with its own training forward."
        )
    result.uncovered = list(range(covered, t_tokens))
    judged_positions: list[Position] = []
    result.positions = judged_positions
    tside = _Side(train, t_tokens, load)
    # the token ids at every position first: a different sequence is NOT COMPARED
    for step in steps:
        side = _Side(step.forward, step.tokens, load)
        for span in step.spans:
            r = side.value((ids[0],), ids[1], span, step.start)
            t = tside.value((train_ids[0],), train_ids[1], span, 0)
            if r is None or t is None or not same_ids(r, t):
                where = (
                    f"position {span[0]}" if span[1] - span[0] == 1 else f"positions {span[0]}-{span[1] - 1}"
                )
                if r is None or t is None:  # a dump shorter than the response: nothing there to compare
                    lost = [side for side, v in (("rollout", r), ("training", t)) if v is None]
                    result.ids_mismatch = (
                        f"the token ids are not recorded at {where} on the {' and '.join(lost)} side (a dump "
                        "shorter than the response: cut short or not written)"
                    )
                    return result
                result.ids_mismatch = (
                    f"the token ids differ at {where} (rollout {ids_text(r)}, training "
                    f"{ids_text(t)}): the rollout steps and the training forward did not see one sequence"
                )
                return result
    plan = pairings(prefill, train)
    spans = [(step, span) for step in steps for span in step.spans]
    errors: dict[tuple[int, int], float | None] = {}  # (pairing, span index) -> error
    dtypes: dict[tuple[int, int], tuple[str, str]] = {}
    sides = [_Side(s.forward, s.tokens, load) for s in steps]
    for pair in plan:
        if pair.note:
            result.not_judged[pair.note] = result.not_judged.get(pair.note, 0) + 1
            continue
        # every file this tensor needs, on both sides, in one load (one process without torch here)
        files = [f for side in sides for f in side.wanted((pair.rollout_key,), pair.label)]
        files += tside.wanted(pair.train_keys, pair.label)
        arrays = load(files) if files else {}
        for side in [*sides, tside]:
            side.fill(arrays)
        for i, (step, span) in enumerate(spans):
            side = sides[steps.index(step)]
            if pair.rollout_key not in step.forward.data:
                continue
            r = side.value((pair.rollout_key,), pair.label, span, step.start)
            t = tside.value(pair.train_keys, pair.label, span, 0)
            if r is None or t is None:
                continue
            errors[(pair.index, i)] = None if is_integer(r.dtype) else relative_error(r, t)
            dtypes[(pair.index, i)] = (t.dtype, r.dtype)
        for s in sides:
            s.drop()
        tside.drop()
    for i, (step, span) in enumerate(spans):
        rows = []
        for pair in plan:
            matched = (pair.index, i) in dtypes
            rows.append(
                own_row(
                    pair.index,
                    f"{pair.rollout_key}.{pair.label}",
                    f"{pair.train_keys[0]}.{pair.label}" if matched else "",
                    errors.get((pair.index, i)),
                    comparable=matched and not pair.note,
                    note=pair.note,
                    dtypes=dtypes.get((pair.index, i), ("", "")),
                )
            )
        judged_positions.append(
            Position(span[0], span[1], step.phase, tuple(judge(apply_engine_conventions(rows))))
        )
    # coverage, both ways: a side cut short (or named otherwise) leaves the other's modules unmet
    outputs = {module_of(f"{p.rollout_key}.{p.label}")[0] for p in plan if p.label.startswith("output")}
    judged = {j.module for p in result.positions for j in p.judgements}
    used = {k for p in result.positions for j in p.judgements for k in plan[j.index].train_keys}
    train_outputs = {k for k, e in train.data.items() if _leaf(e, "output.0") is not None}
    result.coverage = min(
        len(judged & outputs) / len(outputs) if outputs else 0.0,
        len(used & train_outputs) / len(train_outputs) if train_outputs else 0.0,
    )
    return result


def _dump_json(path: Path) -> Path:
    """A dump folder's dump.json, or the path itself when it is one."""
    return path / "dump.json" if path.is_dir() else path


def compare_dumps(
    prefill: Sequence[Path],
    decodes: Sequence[Sequence[Path]],
    train: Path,
    work: Path,
    python: list[str] | None = None,
) -> Result:
    """`compare_request` from msprobe dump folders (or dump.json files): PREFILL and each of
    DECODES are one step's folders, one per TP rank (lowest first; merged under WORK when there
    are several); TRAIN the training forward's. PYTHON: the interpreter that reads tensor files
    when torch does not import here."""
    if not prefill:
        raise UserError("no prefill dump given: pass the request's prefill step folder(s).")
    t = read_forward(_dump_json(train))
    first = read_step([_dump_json(p) for p in prefill], t, work / "prefill", python)
    rest = [
        read_step([_dump_json(p) for p in ranks], t, work / f"decode{k}", python)
        for k, ranks in enumerate(decodes)
    ]
    return compare_request(first, rest, t, load_arrays(python))

"""One rollout dump from the dumps of every tensor-parallel rank of a step: what msprobe is given.

vLLM shards some tensors across TP ranks (DOMAIN §9): column-parallel linears
(`QKVParallelLinear`, `MergedColumnParallelLinear`, `ColumnParallelLinear`) shard their output and
their weight (and bias) on the output features; `RowParallelLinear` shards its input and its weight
on the input features (its output is all-reduced: whole on every rank); `VocabParallelEmbedding`
and `ParallelLMHead` shard their weight on the vocabulary (the embedding's output is all-reduced).
Everything else is replicated and must agree across ranks: a module whose inputs agree across
ranks but whose output (or weight) does not, and a row-parallel or embedding output (all-reduced)
that differs, is a finding of its own (`Disagreement`). A module fed other inputs on each rank
(the heads a rank's attention or rotary embedding sees, the gate/up shard an activation takes)
gives other outputs by design: a shard of a layout the dump does not tell, counted, not judged.

Which tensors are shards is read from the module class in the dump key and checked against the
shapes; a tensor of another class is a shard when its shape is the training tensor's (same module
and role) with one dimension divided by the number of ranks (the q/k norms of Qwen3 see a rank's
heads). Class rule and shapes: the ranks' shapes must agree except on the shard dimension, and where the training dump
holds a tensor of the same module name and role, its shape must be the merged one (else the
tensor is taken as whole, with a note). Never from a model name.

msprobe's statistics merge exactly: max of maxes, min of mins, the mean weighted by element
count, the L2 norm as sqrt(sum of squared norms). Tensor-mode shards (`.pt` files) are listed
(`Merged.shards`: the tensor, its dimension, each rank's file) for `inputs` to concatenate
(`tensor_files`, with torch).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeGuard

from rl_msprobe.jsontypes import JsonObject

COLUMN = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "QKVCrossParallelLinear")
ROW = ("RowParallelLinear",)
VOCAB = ("VocabParallelEmbedding", "ParallelLMHead")
STATS = ("Max", "Min", "Mean", "Norm")
AGREE = 1e-6  # replicated tensors: relative difference of a statistic allowed across ranks
_KEY = re.compile(r"^Module\.(?P<name>.+)\.(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.(?:forward|backward)\.\d+$")


@dataclass
class Disagreement:
    """A replicated tensor that differs between TP ranks: a finding of its own."""

    key: str
    tensor: str  # output.0, parameters.weight, ...
    ranks: list[int]  # the ranks that differ from the lowest rank
    error: float  # largest relative difference of a statistic

    def to_json(self) -> dict[str, object]:
        return {"key": self.key, "tensor": self.tensor, "ranks": self.ranks, "error": self.error}


@dataclass(frozen=True)
class Shard:
    """A tensor merged from TP shards: where it sits in the merged data, on which dimension, and
    each rank's tensor file (tensor mode; empty in statistics mode), lowest rank first."""

    key: str
    cls: str
    role: str
    index: int | str
    dim: int
    files: tuple[str, ...]


@dataclass
class Merged:
    data: JsonObject
    sharded: dict[str, int] = field(default_factory=dict)  # class -> tensors merged from shards
    disagreements: list[Disagreement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unknown: int = 0  # tensors that differ across ranks with no whole training counterpart
    shards: list[Shard] = field(default_factory=list)  # every tensor merged from shards


def shard_dim(cls: str, role: str, index: int | str, ndim: int) -> int | None:
    """The dimension a vLLM parallel module shards this tensor on (None: replicated). `role` is
    input_args / output / parameters; `index` the position or parameter name."""
    if ndim == 0:
        return None
    if cls in COLUMN:
        if role == "output" and index == 0:
            return ndim - 1
        if role == "parameters" and index in ("weight", "bias"):
            return 0
    if cls in ROW:
        if role == "input_args" and index == 0:
            return ndim - 1
        if role == "parameters" and index == "weight":
            return min(1, ndim - 1)
    if cls in VOCAB and role == "parameters" and index == "weight":
        return 0
    return None


def _unbatched(shape: list[int]) -> list[int]:
    """The shape without leading 1-dims (the training side's batch of one)."""
    out = [int(x) for x in shape]
    while len(out) > 1 and out[0] == 1:
        out = out[1:]
    return out


def shard_dim_by_shape(rank: list[int], train: list[int] | None, n: int) -> int | None:
    """The dimension of RANK's shape that is 1/N of the training tensor's (all others equal, the
    training batch of one aside): a shard of a module whose class does not say so (the q/k norms of
    a rank's heads). None when the shapes do not say that."""
    if train is None or n < 2:
        return None
    r, t = _unbatched(rank), _unbatched(train)
    if len(r) != len(t):
        return None
    differ = [i for i, (a, b) in enumerate(zip(r, t)) if a != b]
    if len(differ) != 1 or r[differ[0]] * n != t[differ[0]]:
        return None
    return differ[0] + (len(rank) - len(r))


def _squeezed(shape: list[int]) -> list[int]:
    return [int(x) for x in shape if int(x) != 1]


def is_tensor(leaf: object) -> TypeGuard[JsonObject]:
    """A dump.json leaf that describes a tensor (a shape and msprobe statistics), not a scalar or a list."""
    return isinstance(leaf, dict) and "shape" in leaf and any(k in leaf for k in STATS)


def _count(shape: list[int]) -> int:
    return math.prod(int(x) for x in shape) if shape else 1


def merge_stats(shards: list[JsonObject], dim: int) -> JsonObject:
    """The statistics of the tensor the shards make when concatenated on `dim` (exact for max,
    min and the L2 norm; the mean weighted by element count, exact up to float round-off)."""
    out = dict(shards[0])
    shape = list(shards[0]["shape"])
    shape[dim] = sum(int(s["shape"][dim]) for s in shards)
    out["shape"] = shape
    numbers = [s for s in shards if all(isinstance(s.get(k), (int, float)) for k in STATS)]
    if len(numbers) == len(shards):
        counts = [_count(s["shape"]) for s in shards]
        out["Max"] = max(s["Max"] for s in shards)
        out["Min"] = min(s["Min"] for s in shards)
        total = sum(counts)
        out["Mean"] = sum(s["Mean"] * c for s, c in zip(shards, counts)) / total if total else 0.0
        out["Norm"] = math.sqrt(sum(float(s["Norm"]) ** 2 for s in shards))
    return out


def _differ(a: JsonObject, b: JsonObject) -> float:
    """Largest relative difference of the statistics of two copies of one tensor (0 when equal)."""
    worst = 0.0
    if list(a.get("shape") or []) != list(b.get("shape") or []):
        return float("inf")
    for k in STATS:
        x, y = a.get(k), b.get(k)
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        scale = max(abs(x), abs(y), abs(a.get("Max") or 0), abs(a.get("Min") or 0), 1e-30)
        worst = max(worst, abs(x - y) / scale)
    return worst


def _leaves(entry: JsonObject) -> Iterator[tuple[str, int | str, object]]:
    """(role, index, leaf) of one dump entry's tensors."""
    for role in ("input_args", "output"):
        items = entry.get(role)
        if isinstance(items, list):
            for i, leaf in enumerate(items):
                yield role, i, leaf
    kwargs = entry.get("input_kwargs")
    if isinstance(kwargs, dict):
        for k, leaf in kwargs.items():
            yield "input_kwargs", k, leaf
    params = entry.get("parameters")
    if isinstance(params, dict):
        for k, leaf in params.items():
            yield "parameters", k, leaf


def _label(role: str, index: int | str) -> str:
    return {"input_args": "input", "input_kwargs": "kwargs", "output": "output", "parameters": "parameters"}[
        role
    ] + f".{index}"


def _set(entry: JsonObject, role: str, index: int | str, value: object) -> None:
    entry[role][index] = value


def training_shapes(
    train: JsonObject, tokens: tuple[int, int] | None = None
) -> dict[tuple[str, str], list[int]]:
    """(module name without FSDP wrappers, tensor label) -> shape, from the training dump's data.
    TOKENS (training forward's, rollout step's): a whole-response compare, where the training
    forward has more tokens than the step; its token axis (the first of that size) is given the
    step's count, so that the shapes say what a whole tensor of the step would be."""
    out: dict[tuple[str, str], list[int]] = {}
    for key, entry in train.items():
        m = _KEY.match(key.replace("_fsdp_wrapped_module.", ""))
        if not m or not isinstance(entry, dict):
            continue
        for role, index, leaf in _leaves(entry):
            if is_tensor(leaf):
                shape = [int(x) for x in leaf["shape"]]
                if tokens and tokens[0] in shape:
                    shape[shape.index(tokens[0])] = tokens[1]
                out[(m.group("name"), _label(role, index))] = shape
    return out


def _files(present: list[JsonObject]) -> tuple[str, ...]:
    names = [c.get("data_name") for c in present]
    return tuple(n for n in names if isinstance(n, str)) if all(isinstance(n, str) for n in names) else ()


def merge(
    ranks: list[JsonObject], train: JsonObject | None = None, tokens: tuple[int, int] | None = None
) -> Merged:
    """Merge the `data` of each TP rank's dump.json (lowest rank first) into one (module doc);
    TOKENS: see `training_shapes`."""
    import copy

    base = copy.deepcopy(ranks[0])
    result = Merged(base)
    if len(ranks) == 1:
        return result
    shapes = training_shapes(train or {}, tokens)
    for key, entry in base.items():
        if not isinstance(entry, dict):
            continue
        m = _KEY.match(key)
        cls, name = (m.group("cls"), m.group("name")) if m else ("", key)
        peers: list[JsonObject | None] = [r.get(key) if isinstance(r.get(key), dict) else None for r in ranks]
        spread: list[tuple[str, str, list[int], float]] = []  # unsharded tensors that differ across ranks
        for role, index, leaf in list(_leaves(entry)):
            if not is_tensor(leaf):
                continue
            copies: list[object] = []
            for p in peers:
                try:
                    copies.append(p[role][index] if p is not None else None)
                except (KeyError, IndexError, TypeError):
                    copies.append(None)
            present = [c for c in copies if is_tensor(c)]
            if len(present) < len(ranks):
                continue  # e.g. logits gathered on one rank only: keep what is there
            label = _label(role, index)
            dim = shard_dim(cls, role, index, len(leaf["shape"]))
            if dim is not None:
                merged_shape = list(leaf["shape"])
                merged_shape[dim] = sum(int(c["shape"][dim]) for c in present)
                want = shapes.get((name, label))
                others_agree = all(
                    [x for i, x in enumerate(c["shape"]) if i != dim]
                    == [x for i, x in enumerate(leaf["shape"]) if i != dim]
                    for c in present
                )
                # the training tensor of this name is whole as this rank holds it, yet not merged
                whole_here = (
                    want is not None
                    and _squeezed(want) == _squeezed(leaf["shape"])
                    and _squeezed(want) != _squeezed(merged_shape)
                )
                if not others_agree or whole_here:
                    result.notes.append(
                        f"{key} {label}: {cls} shards it by design, but the shapes say it is whole "
                        f"(ranks {[c['shape'] for c in present]}, training {want}); compared as replicated"
                    )
                    dim = None
            if dim is None and all(list(c["shape"]) == list(leaf["shape"]) for c in present):
                dim = shard_dim_by_shape(list(leaf["shape"]), shapes.get((name, label)), len(present))
                if dim is not None:
                    _set(entry, role, index, merge_stats(present, dim))
                    result.sharded[f"{cls} (by shape)"] = result.sharded.get(f"{cls} (by shape)", 0) + 1
                    result.shards.append(Shard(key, cls, role, index, dim, _files(present)))
                    continue
            if dim is not None:
                _set(entry, role, index, merge_stats(present, dim))
                result.sharded[cls] = result.sharded.get(cls, 0) + 1
                result.shards.append(Shard(key, cls, role, index, dim, _files(present)))
                continue
            differing = [i for i, c in enumerate(present[1:], 1) if _differ(present[0], c) > AGREE]
            if differing:
                spread.append(
                    (role, label, differing, max(_differ(present[0], present[i]) for i in differing))
                )
        inputs_agree = not any(role.startswith("input") for role, *_ in spread)
        for role, label, differing, error in spread:
            if role.startswith("input"):
                continue  # an input carries what came before: judged where it was made
            if role == "output" and not inputs_agree and cls not in ROW + VOCAB:
                # a module fed other inputs on each rank (the heads its attention or rotary
                # embedding sees) gives other outputs: a shard of a layout the dump does not tell
                result.unknown += 1
                continue
            result.disagreements.append(Disagreement(key, label, differing, error))
    return result

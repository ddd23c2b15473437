"""rl-msprobe's own divergence rule, on msprobe's metrics: which module first makes the engines differ.

msprobe's statistics checker warns only when a module's output error is > 10x its input error,
so a 1% change on a bit-identical input passes (DOMAIN §9), and it ranks nothing. Here, per
module in msprobe's forward order:

- a row's relative error `e` comes from msprobe's own columns: statistics mode
  max(|Max diff|, |Min diff|) / max(|Bench max|, |Bench min|) and |L2norm diff| / Bench l2norm
  (NormRelativeErr when only that is there); tensor mode MaxAbsErr / max|Bench| and
  EucDist / Bench l2norm. A uniform 1% change of a tensor reads 1% either way.
- the error a module *received* is the largest `e` of its comparable inputs, or, when it has
  none (vLLM's fused add-RMSNorm takes other quantities), the output error of the module before.
- the noise floor is the error two engines reach on identical weights in the dtypes compared
  (`NOISE_FLOOR`, measured on the live verl job; see the constants).
- a module diverges when its output error exceeds `FLOOR_FACTOR` x the floor AND `GAIN` x the
  error it received: it made a difference of its own. The first such module is the first
  divergence; later modules that only carry it are not. (Weights: `summary.weights_differ`.)

Pure functions over `summary.Row`s; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # summary imports this module
    from rl_msprobe.dumps.summary import Row

# Noise floors (relative error, fraction) for identical weights on both sides, by the coarser dtype
# of the two, measured on the live verl 0.9.1 jobs (tests/live/test_consistency_job.py, 2026-12-01,
# FSDP2 actor vs vLLM CPU): fp32, tiny Qwen2 TP=2, largest clean module error 2.5e-7 (floor 1e-4:
# 400x above it, 100x below a 1% fault); bf16, tiny Qwen3 TP=2, largest clean module error 0.89%
# (an input_layernorm; one bf16 rounding step is 2^-8..2^-7), floor 1.6% (1.8x above it: a bf16
# fault must exceed ~1.6% to be told from noise). fp16 has 3 more mantissa bits than bf16: an
# eighth of its floor (not measured here).
NOISE_FLOOR = {"fp32": 1e-4, "bf16": 1.6e-2, "fp16": 2e-3}
FLOOR_FACTOR = 1.0  # the output error must exceed the floor itself ...
GAIN = 4.0  # ... and this many times the error the module received
DTYPE_NAMES = {
    "torch.float32": "fp32",
    "float32": "fp32",
    "torch.float64": "fp32",
    "torch.bfloat16": "bf16",
    "bfloat16": "bf16",
    "torch.float16": "fp16",
    "float16": "fp16",
}
_ORDER = ("fp32", "fp16", "bf16")  # coarser last


def precision_of(*dtypes: str) -> str:
    """The coarsest floating precision among msprobe's dtype strings (`a;b` joins aggregated rows)."""
    found = {
        name
        for text in dtypes
        for d in (text or "").split(";")
        if (name := DTYPE_NAMES.get(d.strip())) is not None
    }
    return max(found, key=_ORDER.index) if found else "fp32"


def is_integer(*dtypes: str) -> bool:
    parts = [d.strip() for text in dtypes for d in (text or "").split(";") if d.strip()]
    return bool(parts) and all(("int" in d or "bool" in d) and "float" not in d for d in parts)


@dataclass(frozen=True)
class Judgement:
    """One module's output judged against its input and the noise floor."""

    index: int  # msprobe's row index of the output judged
    module: str
    tensor: str
    layer: int | None
    error: float  # relative error of the output (fraction)
    received: float  # relative error the module received (fraction)
    floor: float  # noise floor for the dtypes compared
    precision: str
    divergent: bool

    @property
    def floor_ratio(self) -> float:
        return self.error / self.floor if self.floor else float("inf")

    @property
    def gain(self) -> float:
        """Output error over what came in (or the floor, whichever is larger)."""
        return self.error / max(self.received, self.floor)

    def to_json(self) -> dict[str, object]:
        return {
            "module": self.module,
            "tensor": self.tensor,
            "layer": self.layer,
            "error": self.error,
            "received": self.received,
            "floor": self.floor,
            "precision": self.precision,
            "floor_ratio": round(self.floor_ratio, 3),
            "gain": round(self.gain, 3),
            "divergent": self.divergent,
        }


def judge(rows: list[Row], floors: dict[str, float] | None = None) -> list[Judgement]:
    """Judge every module output in forward order (`rows`: summary.Row, msprobe's order)."""
    floors = floors or NOISE_FLOOR
    by_module: dict[str, list[Row]] = {}
    order: list[str] = []
    for r in rows:
        if r.module not in by_module:
            order.append(r.module)
        by_module.setdefault(r.module, []).append(r)
    out: list[Judgement] = []
    carried = 0.0
    for module in order:
        group = by_module[module]
        # (row, its error) of the rows with a number to judge
        measured = [(r, r.error) for r in group if r.comparable and r.matched and r.error is not None]
        inputs = [e for r, e in measured if r.tensor.startswith(("input", "kwargs"))]
        outputs = [(r, e) for r, e in measured if r.tensor.startswith("output")]
        if not outputs:
            continue
        received = max(inputs) if inputs else carried
        worst, error = max(outputs, key=lambda re: re[1])
        precision = precision_of(worst.train_dtype, worst.rollout_dtype)
        floor = floors.get(precision, floors["fp32"])
        divergent = error > FLOOR_FACTOR * floor and error > GAIN * received
        out.append(
            Judgement(
                worst.index,
                module,
                worst.tensor,
                worst.layer,
                error,
                received,
                floor,
                precision,
                divergent,
            )
        )
        carried = error
    return sorted(out, key=lambda j: j.index)


@dataclass(frozen=True)
class JudgedModule:
    """`judge`'s answer for one module at many positions at once (numpy arrays over positions;
    `measured` False where the module had no output to judge, the other arrays then undefined)."""

    module: str
    measured: Any  # bool[positions]
    worst: Any  # int[positions]: which of the module's outputs was the worst (its order given)
    error: Any  # float[positions]
    received: Any
    floor: Any
    divergent: Any  # bool[positions]


def judge_arrays(
    modules: list[tuple[str, list[Any], list[tuple[Any, float]]]], positions: int
) -> list[JudgedModule | None]:
    """`judge`'s rule over many positions at once, for errors already measured per position:
    MODULES in forward order, each (name, its input errors, its outputs as (errors, noise floor)),
    every error an array over POSITIONS with NaN where that tensor was not measured. The same
    decisions as `judge` makes on each position's rows (a test holds them equal); None for a
    module without outputs."""
    import numpy as np

    carried = np.zeros(positions)
    out: list[JudgedModule | None] = []
    for name, inputs, outputs in modules:
        if not outputs:
            out.append(None)
            continue
        errors = np.stack([np.asarray(e, dtype=np.float64) for e, _ in outputs])
        floors = np.array([f for _, f in outputs], dtype=np.float64)
        measured = ~np.isnan(errors).all(axis=0)
        worst = np.argmax(np.where(np.isnan(errors), -np.inf, errors), axis=0)
        error = np.take_along_axis(errors, worst[None, :], axis=0)[0]
        received = carried
        if inputs:
            ins = np.stack([np.asarray(e, dtype=np.float64) for e in inputs])
            has_input = ~np.isnan(ins).all(axis=0)
            largest = np.max(np.where(np.isnan(ins), -np.inf, ins), axis=0)
            received = np.where(has_input, largest, carried)
        floor = floors[worst]
        divergent = measured & (error > FLOOR_FACTOR * floor) & (error > GAIN * received)
        out.append(JudgedModule(name, measured, worst, error, received, floor, divergent))
        carried = np.where(measured, error, carried)
    return out

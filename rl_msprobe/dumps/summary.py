"""Reading msprobe's compare result CSV: per-row verdicts, first divergence, per-layer curve.

The metrics and the pass / warning / error verdicts are msprobe's own (`Cosine`, `MaxAbsErr`,
`Result`, `Err_message` in tensor mode; `Max diff`, `NormRelativeErr` in statistics mode).
This module only reads them, in msprobe's forward order, and decides which rows can be
read as numbers at all:

- rows msprobe could not pair or measure (`unsupported`, `shape unmatched`, `N/A`, one side
  missing) are structural, not numeric divergence;
- vLLM's calling conventions that msprobe pairs by name although the tensors differ (seen
  on a real vLLM CPU engine against transformers' Qwen2 with identical weights):
  `SiluAndMul` returns `silu(gate) * up` where the training `act_fn` returns `silu(gate)`;
  a decoder layer returns `(hidden, residual)` and leaves the residual add to the next
  layer's fused add-RMSNorm, which takes `(hidden, residual)` as two inputs; token ids are
  int32 where training has int64, and `positions` come first. Such rows are *not
  comparable*; the modules inside (projections, attention, MLP, norm outputs) still are.
- a module's own weights (`parameters.*` rows), statistics mode: msprobe's statistics checkers
  judge a module's outputs against its inputs and never its weights, so a weight that differs
  between the engines passes, and behind vLLM's fused add-RMSNorm (whose input is another
  quantity) so does its output. After the weight sync both engines hold the same weights: a
  same-shape weight whose norm differs by more than `WEIGHT_TOLERANCE` (round-off between two
  dtypes is ~0.4%) is rl-msprobe's own finding, marked `error` with a message saying so.
- msprobe's "Required_Grad inconsistent": the actor's parameters (and, with grad enabled, its
  activations) require grad, vLLM's never do. A row whose *only* complaints are that and the
  engines' layouts is not comparable by convention; a numeric complaint still counts.

A pair also says how much was compared at all: rows msprobe matched (both names present) and
the share of rollout modules that found a training counterpart (`coverage`), so that a compare
whose names never met cannot pass for a consistent one (see `report.verdict`).
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeAlias

from rl_msprobe.dumps.judge import Judgement, is_integer, judge
from rl_msprobe.dumps.tp_merge import Disagreement

NPU, BENCH = "NPU Name", "Bench Name"  # msprobe: NPU = -tp = training, Bench = -gp = rollout
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CALL = re.compile(r"\.(forward|backward)(?:\.\d+)?\.")
_FSDP = "_fsdp_wrapped_module."
DIVERGENT = ("error", "warning")


# one row of msprobe's compare_result CSV: column -> cell (None where a row is short)
Record: TypeAlias = Mapping[str, str | None]


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    t = text.strip().rstrip("%")
    try:
        v = float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def module_of(name: str) -> tuple[str, str]:
    """`Module.model.layers.1.mlp.down_proj.RowParallelLinear.forward.0.output.0` ->
    (`model.layers.1.mlp.down_proj`, `output.0`). API rows keep their API name."""
    name = name.split(";", 1)[0].strip().replace(_FSDP, "")
    m = _CALL.search(name)
    if not m:
        return name, ""
    head, tail = name[: m.start()], name[m.end() :]
    if head.startswith("Module."):
        head = head[len("Module.") :].rsplit(".", 1)[0]  # drop the class name
    elif re.search(r"\.\d+$", head):
        head = head.rsplit(".", 1)[0]  # API rows: drop the call count
    return head, tail


def _present(name: str) -> bool:
    return bool(name) and name != "N/A"


@dataclass(frozen=True)
class Row:
    index: int  # msprobe's (forward) order
    train_name: str
    rollout_name: str
    module: str
    tensor: str  # input.0, output.0, parameters.weight, ...
    layer: int | None
    cosine: float | None  # Cosine (tensor mode); None in statistics mode
    max_abs_err: float | None  # MaxAbsErr (tensor) / |Max diff| (statistics)
    rel_err: float | None  # MaxRelativeErr (tensor) / NormRelativeErr (statistics)
    result: str
    message: str
    comparable: bool
    note: str = ""
    train_dtype: str = ""
    rollout_dtype: str = ""
    error: float | None = None  # relative error (fraction) from msprobe's columns (judge module doc)
    finding: bool = False  # rl-msprobe's verdict on this row (judge), set by `summarize`
    same: bool | None = None  # integer rows: both sides' statistics equal (None: not known)

    @property
    def matched(self) -> bool:
        """msprobe paired this row with a row of the other side."""
        return _present(self.train_name) and _present(self.rollout_name)

    @property
    def divergent(self) -> bool:
        """rl-msprobe's finding (judge: output error beyond its input's and the noise floor; or the
        engines hold different weights). msprobe's own pass/warning/error is `result`."""
        return self.finding

    @property
    def msprobe_flagged(self) -> bool:
        return self.comparable and self.result in DIVERGENT and not self.note

    def to_json(self) -> dict[str, object]:
        return {
            k: v
            for k, v in asdict(self).items()
            if k not in ("index", "comparable", "train_dtype", "rollout_dtype", "same")
        }


@dataclass(frozen=True)
class LayerPoint:
    layer: str  # "embed", "0", "1", ..., "head"
    depth: int
    cosine: float | None  # worst (lowest) cosine of the layer's outputs
    max_abs_err: float | None  # worst (highest) error of the layer's outputs
    divergent: int  # rows msprobe marked warning/error in this layer (comparable only)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class PairSummary:
    mode: str  # tensor | statistics
    rows: list[Row]
    counts: dict[str, int] = field(default_factory=dict)  # msprobe Result -> rows
    not_comparable: int = 0
    layers: list[LayerPoint] = field(default_factory=list)
    judgements: list[Judgement] = field(default_factory=list)  # per module, forward order
    input_mismatch: str | None = None  # the two sides saw different inputs: how (then NOT COMPARED)
    inputs_checked: list[str] = field(default_factory=list)  # integer rows found equal on both sides

    @property
    def divergent(self) -> list[Row]:
        return [r for r in self.rows if r.divergent]

    @property
    def first_divergence(self) -> Row | None:
        return next((r for r in self.rows if r.divergent), None)

    @property
    def first_judgement(self) -> Judgement | None:
        first = self.first_divergence
        return next((j for j in self.judgements if first and j.index == first.index), None)

    @property
    def consistent(self) -> bool:
        return not self.divergent

    @property
    def msprobe_flagged(self) -> int:
        return sum(1 for r in self.rows if r.msprobe_flagged)

    def ranked(self, n: int = 10) -> list[tuple[Row, Judgement]]:
        """Module outputs ranked by the judgement: findings first, then by gain over what came in."""
        by_index = {r.index: r for r in self.rows}
        order = sorted(self.judgements, key=lambda j: (not j.divergent, -j.gain, -j.floor_ratio))
        return [(by_index[j.index], j) for j in order[:n]]

    def floors(self) -> dict[str, float]:
        """Noise floor by precision, as applied to this pair's rows."""
        return {j.precision: j.floor for j in self.judgements}

    @property
    def matched_rows(self) -> int:
        return sum(1 for r in self.rows if r.matched)

    @property
    def rollout_modules(self) -> set[str]:
        return {r.module for r in self.rows if _present(r.rollout_name)}

    @property
    def matched_modules(self) -> set[str]:
        return {r.module for r in self.rows if r.matched}

    @property
    def coverage(self) -> float:
        """Share of the rollout's modules that msprobe matched to a training module (0 when none)."""
        expected = self.rollout_modules
        return len(self.matched_modules & expected) / len(expected) if expected else 0.0

    def dtype_pairs(self) -> dict[str, int]:
        """`training dtype -> rollout dtype` for matched, comparable rows whose dtypes differ, with
        row counts (msprobe joins the dtypes of training rows it aggregated with `;`)."""
        out: dict[str, int] = {}
        for r in self.rows:
            if not (r.matched and r.comparable):
                continue
            train = ";".join(sorted({d.strip() for d in r.train_dtype.split(";") if d.strip()}))
            rollout = ";".join(sorted({d.strip() for d in r.rollout_dtype.split(";") if d.strip()}))
            if train and rollout and train != rollout:
                key = f"{train} -> {rollout}"
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def worst(self, n: int = 5) -> list[Row]:
        measured = [
            r for r in self.rows if r.comparable and (r.cosine is not None or r.max_abs_err is not None)
        ]
        key = (
            (lambda r: (r.cosine if r.cosine is not None else 2.0, -(r.max_abs_err or 0.0)))
            if self.mode == "tensor"
            else (lambda r: -(r.max_abs_err or 0.0))
        )
        return sorted(measured, key=key)[:n]

    def to_json(self, rows: bool = False) -> dict[str, object]:
        first = self.first_divergence
        doc: dict[str, object] = {
            "mode": self.mode,
            "consistent": self.consistent,
            "counts": self.counts,
            "divergent_rows": len(self.divergent),
            "not_comparable_rows": self.not_comparable,
            "row_count": len(self.rows),
            "matched_rows": self.matched_rows,
            "rollout_modules": len(self.rollout_modules),
            "matched_modules": len(self.matched_modules & self.rollout_modules),
            "coverage": round(self.coverage, 4),
            "dtypes": self.dtype_pairs(),
            "first_divergence": first.to_json() if first else None,
            "first_judgement": self.first_judgement.to_json() if self.first_judgement else None,
            "msprobe_flagged_rows": self.msprobe_flagged,
            "noise_floor": self.floors(),
            "input_mismatch": self.input_mismatch,
            "inputs_checked": self.inputs_checked,
            "ranked": [{**r.to_json(), "judgement": j.to_json()} for r, j in self.ranked(5)],
            "worst": [r.to_json() for r in self.worst()],
            "layers": [p.to_json() for p in self.layers],
        }
        if rows:
            doc["rows"] = [r.to_json() for r in self.rows]
        return doc


def _structural_note(train_name: str, rollout_name: str, sim_text: str, tensor: str) -> str:
    if not train_name or train_name == "N/A" or not rollout_name or rollout_name == "N/A":
        return "only on one side"
    if ".SiluAndMul." in rollout_name and ".SiluAndMul." not in train_name:
        return "vLLM SiluAndMul returns silu(gate)*up, the training act_fn silu(gate): different quantities"
    text = sim_text.strip()
    if text == "shape unmatched" and not tensor.startswith(("input", "kwargs")):
        # an output or weight of different shape is a finding (other tokens, other weights),
        # unlike inputs, whose argument layout differs between engines (positions first in vLLM)
        return ""
    if text == "shape unmatched":
        return "msprobe: shape unmatched on an input (argument layouts differ between engines)"
    if _number(text) is None and text not in ("", "N/A"):
        return f"msprobe: {text} (no metric for this row)"
    return ""


_LAYOUT_MESSAGES = (
    "The dtype of NPU and Bench are inconsistent",
    "The shape of NPU and Bench are inconsistent",
)
_GRAD_MESSAGE = "The Required_Grad of NPU and Bench are inconsistent"
GRAD_NOTE = (
    "requires_grad differs by convention (the actor's tensors require grad, vLLM's never do); "
    "no other complaint"
)


WEIGHT_TOLERANCE = 1.0  # NormRelativeErr, percent: bf16 vs fp32 copies of one weight differ ~0.4%
WEIGHT_MESSAGE = "rl-msprobe: the engines hold different weights"


def weights_differ(rec: Record, tensor: str, mode: str, rel: float | None) -> str:
    """rl-msprobe's complaint about a module's weight (module doc), '' when there is none."""
    if (
        mode != "statistics"
        or not tensor.startswith("parameters")
        or rel is None
        or abs(rel) <= WEIGHT_TOLERANCE
    ):
        return ""
    shapes = (_squeeze(rec.get("NPU Tensor Shape") or ""), _squeeze(rec.get("Bench Tensor Shape") or ""))
    if shapes[0] != shapes[1] or not shapes[0]:
        return ""
    return f"{WEIGHT_MESSAGE}: NormRelativeErr {abs(rel):g}% > {WEIGHT_TOLERANCE:g}%"


def _complaints(message: str) -> list[str] | None:
    """msprobe's Err_message items (a JSON list), or None when it is not one."""
    try:
        items = json.loads(message) if message else []
    except ValueError:
        return None
    return [str(i) for i in items] if isinstance(items, list) else None


def _only_layout_complaints(message: str) -> bool:
    """Every complaint is about dtype / shape (Required_Grad, a convention, may come along)."""
    items = [i for i in _complaints(message) or () if _GRAD_MESSAGE not in i]
    return bool(items) and all(any(m in i for m in _LAYOUT_MESSAGES) for i in items)


def _squeeze(shape: str) -> str:
    return ",".join(p.strip() for p in shape.strip().strip("[]").split(",") if p.strip() not in ("1", ""))


def _shape_waiver(items: list[str], rec: Record, rollout: str) -> str:
    """msprobe's statistics checkers compare shapes as they are, where its tensor consistency
    checker squeezes 1-dims ([1, T, H] vs [T, H]) and skips the fused qkv / gate_up rows; read
    a shape-only complaint the way the consistency checker would."""
    if not items or not all(_LAYOUT_MESSAGES[1] in i for i in items):
        return ""
    if "qkv" in rollout or "gate_up" in rollout:
        return "fused module: shapes differ by design (msprobe's consistency checker skips it too)"
    if _squeeze(rec.get("NPU Tensor Shape") or "") == _squeeze(rec.get("Bench Tensor Shape") or ""):
        return "shape differs only by 1-dims (squeezed, as msprobe's consistency checker does)"
    return ""


def convention_waiver(rec: Record, rollout: str, mode: str) -> str:
    """Why a row msprobe flagged differs only by engine convention ('' when it does not):
    Required_Grad alone (any mode), or shape-only complaints msprobe's tensor checker would not
    raise (statistics mode). Any other complaint (numbers, dtype) keeps the row divergent."""
    items = _complaints(rec.get("Err_message") or "")
    if not items:
        return ""
    rest = [i for i in items if _GRAD_MESSAGE not in i]
    grad = len(rest) < len(items)
    if not rest:
        return GRAD_NOTE if grad else ""
    shape = _shape_waiver(rest, rec, rollout) if mode == "statistics" else ""
    if shape and grad:
        return f"{shape}; requires_grad differs by convention"
    return shape


def _rollout_class(name: str) -> str:
    head = name.split(";", 1)[0].strip()
    m = _CALL.search(head)
    return head[: m.start()].rsplit(".", 1)[-1] if m and head.startswith("Module.") else ""


def apply_engine_conventions(rows: list[Row]) -> list[Row]:
    """Mark rows whose two sides are different quantities by engine convention (module doc)."""
    rollout_only = {
        (r.module, r.tensor)
        for r in rows
        if r.note == "only on one side" and r.rollout_name not in ("", "N/A")
    }
    out = []
    for r in rows:
        note = ""
        if r.comparable:  # a waived row too: the engine convention is the truer reason
            cls = _rollout_class(r.rollout_name)
            if (
                cls.endswith("DecoderLayer")
                and r.tensor == "output.0"
                and (r.module, "output.1") in rollout_only
            ):
                note = (
                    "vLLM's decoder layer returns (hidden, residual); the residual is added in the next norm"
                )
            elif "Norm" in cls and r.tensor == "input.0" and (r.module, "input.1") in rollout_only:
                note = "vLLM's fused add-RMSNorm takes hidden and residual as two inputs"
            elif (
                not r.note
                and r.tensor.startswith(("input", "kwargs"))
                and r.result in DIVERGENT
                and _only_layout_complaints(r.message)
                and (r.cosine is None or r.cosine >= 0.99999)
            ):
                note = "input dtype/shape differs between engines (e.g. int32 token ids), values agree"
        out.append(replace(r, note=note, comparable=False) if note else r)
    return out


def parse_rows(csv_path: Path) -> tuple[str, list[Row]]:
    """Rows of one msprobe compare_result CSV, in its order, and the dump mode it was made in."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    from rl_msprobe import bounded

    with bounded.open_text(csv_path, "msprobe compare_result CSV", bounded.DUMP_JSON) as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        mode = "tensor" if "Cosine" in fields else "statistics"
        rows = []
        for i, rec in enumerate(reader):
            train, rollout = (rec.get(NPU) or "").strip(), (rec.get(BENCH) or "").strip()
            if mode == "tensor":
                sim_text = rec.get("Cosine") or ""
                sim, err, rel = (
                    _number(sim_text),
                    _number(rec.get("MaxAbsErr")),
                    _number(rec.get("MaxRelativeErr")),
                )
            else:
                sim_text = rec.get("Max diff") or ""
                sim = None
                diff = _number(sim_text)
                err = abs(diff) if diff is not None else None
                rel = _number(rec.get("NormRelativeErr"))
            name = rollout if rollout and rollout != "N/A" else train
            module, tensor = module_of(name)
            note = _structural_note(train, rollout, sim_text, tensor)
            if not note and sim is None and err is None and sim_text.strip() != "shape unmatched":
                note = "no metric"
            waiver = "" if note else convention_waiver(rec, rollout, mode)
            result, message = (rec.get("Result") or "").strip(), (rec.get("Err_message") or "").strip()
            weights = "" if note else weights_differ(rec, tensor, mode, rel)
            if weights:
                result, message = "error", json.dumps([*(_complaints(message) or []), weights])
            m = _LAYER.search(module + ".")
            error, same = _relative_error(rec, mode, rel)
            rows.append(
                Row(
                    index=i,
                    train_name=train,
                    rollout_name=rollout,
                    module=module,
                    tensor=tensor,
                    layer=int(m.group(1)) if m else None,
                    cosine=sim,
                    max_abs_err=err,
                    rel_err=rel,
                    result=result,
                    message=message,
                    comparable=not note,
                    note=note or ("" if weights else waiver),
                    train_dtype=(rec.get("NPU Dtype") or "").strip(),
                    rollout_dtype=(rec.get("Bench Dtype") or "").strip(),
                    error=error,
                    finding=bool(weights),
                    same=same,
                )
            )
    return mode, apply_engine_conventions(rows)


def _abs(rec: Record, key: str) -> float | None:
    v = _number(rec.get(key))
    return abs(v) if v is not None else None


def _relative_error(
    rec: Record, mode: str, norm_rel_percent: float | None
) -> tuple[float | None, bool | None]:
    """(relative error as a fraction, whether every statistic is equal) from msprobe's columns
    (judge module doc); (None, None) where msprobe gave no number."""
    scale = max((v for v in (_abs(rec, "Bench max"), _abs(rec, "Bench min")) if v is not None), default=None)
    norm = _abs(rec, "Bench l2norm")
    if mode == "tensor":
        spread, dist = _abs(rec, "MaxAbsErr"), _abs(rec, "EucDist")
    else:
        diffs = [_abs(rec, k) for k in ("Max diff", "Min diff")]
        spread = max((d for d in diffs if d is not None), default=None)
        dist = _abs(rec, "L2norm diff")
    parts = []
    if spread is not None and scale is not None:
        parts.append(spread / scale if scale > 0 else (0.0 if spread == 0 else float("inf")))
    if dist is not None and norm is not None:
        parts.append(dist / norm if norm > 0 else (0.0 if dist == 0 else float("inf")))
    elif norm_rel_percent is not None and mode != "tensor":
        parts.append(abs(norm_rel_percent) / 100)
    if not parts and mode == "tensor":
        cos = _number(rec.get("Cosine"))
        if cos is not None:  # no scale given: the distance between the two directions
            parts.append(math.sqrt(max(0.0, 2 * (1 - min(cos, 1.0)))))
    if not parts and spread is not None and mode != "tensor":
        parts.append(0.0 if spread == 0 else float("inf"))  # only a diff: equal or not
    keys = ("Max diff", "Min diff", "Mean diff", "L2norm diff") if mode != "tensor" else ("MaxAbsErr",)
    values = [_number(rec.get(k)) for k in keys]
    same = None if any(v is None for v in values) else all(v == 0 for v in values)
    return (max(parts) if parts else None), same


def layer_curve(rows: list[Row]) -> list[LayerPoint]:
    """Worst output metrics per decoder layer along depth, with `embed` before and `head` after."""
    first = next((r.index for r in rows if r.layer is not None), None)
    groups: dict[tuple[int, str], list[Row]] = {}
    last_layer = max((r.layer for r in rows if r.layer is not None), default=-1)
    for r in rows:
        if r.layer is not None:
            key = (r.layer, str(r.layer))
        elif first is None or r.index < first:
            key = (-1, "embed")
        else:
            key = (last_layer + 1, "head")
        groups.setdefault(key, []).append(r)
    points = []
    for (depth, label), grp in sorted(groups.items()):
        outs = [r for r in grp if r.comparable and r.tensor.startswith("output")]
        sims = [r.cosine for r in outs if r.cosine is not None]
        errs = [r.max_abs_err for r in outs if r.max_abs_err is not None]
        points.append(
            LayerPoint(
                label,
                depth,
                min(sims) if sims else None,
                max(errs) if errs else None,
                sum(1 for r in grp if r.divergent),
            )
        )
    return points


def _unmeasured_output(r: Row) -> bool:
    """An output msprobe flagged that has no number to judge (its shapes differ, e.g. other tokens):
    a structural finding, unless a convention explains it (then it is not comparable)."""
    return (
        r.comparable
        and r.matched
        and r.tensor.startswith("output")
        and r.error in (None, 0.0)
        and (r.msprobe_flagged and (r.cosine is None and (r.max_abs_err in (None, 0.0))))
    )


def input_identity(rows: list[Row]) -> tuple[str | None, list[str]]:
    """Did both sides see the same input? From the matched integer input rows (token ids,
    positions): (how they differ, or None; the rows found equal)."""
    checked, problem = [], None
    for r in rows:
        if not (
            r.matched
            and r.tensor.startswith(("input", "kwargs"))
            and is_integer(r.train_dtype, r.rollout_dtype)
        ):
            continue
        where = f"{r.module} {r.tensor}"
        if r.same is False and problem is None:
            problem = (
                f"the two sides saw different inputs: {where} (integer, e.g. token ids) differs "
                f"(max diff {r.max_abs_err:g})"
                if r.max_abs_err is not None
                else f"{where} differs"
            )
        elif r.same:
            checked.append(where)
    return problem, checked


def summarize(csv_path: Path) -> PairSummary:
    mode, rows = parse_rows(csv_path)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.result or "none"] = counts.get(r.result or "none", 0) + 1
    judgements = judge(rows)
    findings = {j.index for j in judgements if j.divergent} | {r.index for r in rows if _unmeasured_output(r)}
    rows = [replace(r, finding=True) if r.index in findings else r for r in rows]
    mismatch, checked = input_identity(rows)
    return PairSummary(
        mode=mode,
        rows=rows,
        counts=counts,
        not_comparable=sum(1 for r in rows if not r.comparable),
        layers=layer_curve(rows),
        judgements=judgements,
        input_mismatch=mismatch,
        inputs_checked=checked,
    )


def own_row(
    index: int,
    rollout_name: str,
    train_name: str,
    error: float | None,
    *,
    result: str = "",
    message: str = "",
    comparable: bool = True,
    note: str = "",
    dtypes: tuple[str, str] = ("", ""),
    finding: bool = False,
) -> Row:
    """A row rl-msprobe measured itself (not read from msprobe's CSV): module, tensor and layer
    from the rollout name; DTYPES (training, rollout)."""
    module, tensor = module_of(rollout_name)
    m = _LAYER.search(module + ".")
    return Row(
        index=index,
        train_name=train_name,
        rollout_name=rollout_name,
        module=module,
        tensor=tensor,
        layer=int(m.group(1)) if m else None,
        cosine=None,
        max_abs_err=None,
        rel_err=None,
        result=result,
        message=message,
        comparable=comparable,
        note=note,
        train_dtype=dtypes[0],
        rollout_dtype=dtypes[1],
        error=error,
        finding=finding,
    )


TP_MESSAGE = "rl-msprobe: a replicated tensor differs between tensor-parallel ranks"


def with_tp_findings(summary: PairSummary, disagreements: list[Disagreement]) -> PairSummary:
    """The summary with a finding row for each replicated tensor that differs between TP ranks
    (tp_merge.Disagreement), placed before that module's first row (forward order)."""
    if not disagreements:
        return summary
    rows = list(summary.rows)
    for d in disagreements:
        name = f"{d.key}.{d.tensor}"
        module, tensor = module_of(name)
        at = next((i for i, r in enumerate(rows) if r.module == module), len(rows))
        msg = f"{TP_MESSAGE}: rank(s) {', '.join(map(str, d.ranks))} differ from the lowest rank by {d.error:.3g}"
        index = rows[at].index if at < len(rows) else len(rows)
        rows.insert(
            at,
            own_row(index, name, "", d.error, result="error", message=json.dumps([msg]), finding=True),
        )
    return replace(summary, rows=rows, layers=layer_curve(rows))

"""`mismatch report`'s sections on the distribution per position and the semantic causes.

Reads the lines that carry a ``distribution`` (schema ``rl-msprobe-triage/2`` with
``prepare --mode triage --top-k K``) or a ``rollout_prompt_ids``; older lines (schema /1) have
neither and leave these sections empty. Per step: the distribution metrics averaged over
tokens (beside verl's ``training/rollout_probs_diff_mean``, which the gap table has), per
position across the run, and the causes `semantics.diagnose` names from the step's evidence.

Memory: per step one `Sums` and one `Evidence` (bounded sums, per-position arrays as long as
the longest response), never one entry per line. Only lines that have one of the two keys are
parsed whole by json here (the gap itself is streamed by stream.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.triage.distribution import BadDistribution, Sums, parse, position_metrics
from rl_msprobe.triage.semantics import Cause, Evidence, diagnose, request_evidence
from rl_msprobe.triage.stream import Scalar, log_files, step_order

ROLLOUT_KEYS = ("temperature", "top_p", "top_k", "logprobs_mode", "name")


@dataclass
class StepDistribution:
    step: Scalar
    sums: Sums = field(default_factory=Sums)
    evidence: Evidence = field(default_factory=Evidence)
    causes: list[Cause] = field(default_factory=list)


@dataclass
class DistributionResult:
    steps: dict[Scalar, StepDistribution] = field(default_factory=dict)
    overall: Sums = field(default_factory=Sums)
    causes: list[Cause] = field(default_factory=list)  # over the whole run
    cause_steps: dict[str, list[Scalar]] = field(default_factory=dict)  # cause -> the steps that show it
    bad: list[str] = field(default_factory=list)
    k: int | None = None
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def present(self) -> bool:
        return bool(self.steps)

    def step_list(self) -> list[StepDistribution]:
        return [self.steps[s] for s in sorted(self.steps, key=step_order)]

    @property
    def semantic(self) -> list[Cause]:
        return [c for c in self.causes if c.semantic]

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "overall": self.overall.to_json(),
            "steps": [
                {
                    "step": s.step,
                    **s.sums.to_json(),
                    "causes": [c.name for c in s.causes],
                    "kl_low_by_position": [_finite(v) for v in s.sums.by_position("kl_low").tolist()],
                    "top1_by_position": [_finite(v) for v in s.sums.by_position("top1").tolist()],
                }
                for s in self.step_list()
            ],
            "by_position": {
                key: [_finite(v) for v in self.overall.by_position(key).tolist()]
                for key in ("kl_low", "top1")
            },
            "causes": [{**c.to_json(), "steps": self.cause_steps.get(c.name, [])} for c in self.causes],
            "settings": self.settings,
            "bad_lines": self.bad[:10],
        }


def read_distribution(root: Path, settings: dict[str, str] | None = None) -> DistributionResult:
    """Every line with a distribution (or the rollout's prompt ids) under ROOT, per step."""
    out = DistributionResult(settings=dict(settings or {}))
    from rl_msprobe import bounded

    for path in log_files(root):
        with bounded.open_regular(path, "triage log") as f:
            for number, raw in enumerate(bounded.lines(f, path, "triage"), 1):
                if b'"distribution"' not in raw and b'"rollout_prompt_ids"' not in raw:
                    continue
                try:
                    _add(out, json.loads(raw))
                except (ValueError, BadDistribution, TypeError, KeyError) as exc:
                    out.bad.append(f"{path}:{number}: {exc}")
    merged = Evidence()
    for s in out.step_list():
        s.causes = diagnose(s.evidence, out.settings)
        for c in s.causes:
            out.cause_steps.setdefault(c.name, []).append(s.step)
        merged.merge(s.evidence)
    # the run's verdict: the causes of the steps (a cause in some steps only is named with them)
    named = {c.name: c for s in out.step_list() for c in s.causes if c.semantic}
    out.causes = list(named.values()) or diagnose(merged, out.settings)
    return out


def _add(out: DistributionResult, doc: Any) -> None:
    if not isinstance(doc, dict) or "error" in doc:
        return
    step = doc.get("step")
    if not isinstance(step, (int, float, str)) or isinstance(step, bool):
        step = None
    entry = out.steps.setdefault(step, StepDistribution(step))
    req = None
    if doc.get("distribution") is not None:
        req = parse(doc["distribution"])
        out.k = out.k or doc["distribution"].get("k")
        metrics = position_metrics(req)
        entry.sums.add(metrics)
        out.overall.add(metrics)
    ev = request_evidence(
        req,
        _floats(doc.get("rollout_log_probs")),
        _floats(doc.get("train_log_probs")),
        prompt_ids=doc.get("prompt_ids"),
        rollout_prompt_ids=doc.get("rollout_prompt_ids"),
    )
    entry.evidence.merge(ev)


def _floats(values: Any) -> list[float]:
    if not isinstance(values, list):
        return []
    return [math.nan if v is None else float(v) for v in values]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def script_settings(script: Path | None) -> dict[str, str]:
    """The launch script's rollout sampling keys (``actor_rollout_ref.rollout.<key>``), as written."""
    if script is None:
        return {}
    from rl_msprobe.launch.overrides import Overrides
    from rl_msprobe.triage.propose import read_script

    parsed = read_script(script)
    if parsed.command is None:
        return {}
    overrides = Overrides(parsed.command.args)
    out = {}
    for key in ROLLOUT_KEYS:
        found = overrides.get(f"actor_rollout_ref.rollout.{key}")
        if (
            found is not None
            and isinstance(found.value, (str, int, float))
            and not isinstance(found.value, bool)
        ):
            out[key] = str(found.value)
    return out


# ---------------------------------------------------------------------------- report sections


def fmt(x: Any) -> str:
    from rl_msprobe.triage.report import fmt as _fmt

    return _fmt(x)


def step_table(result: DistributionResult, verl_dp: dict[Scalar, float]) -> tuple[list[str], list[list[str]]]:
    head = [
        "step",
        "tokens",
        "verl mean |Δp|",
        "mean KL (≥)",
        "max KL (≥)",
        "TV (low–high)",
        "top-k overlap",
        "top-1 agree",
        "worst position top-1",
        "entropy gap",
        "verdict",
    ]
    rows = []
    for s in result.step_list():
        j = s.sums.to_json()
        rows.append(
            [
                fmt(s.step),
                str(j["tokens"]),
                fmt(verl_dp.get(s.step)),
                fmt(s.sums.mean("kl_low")),
                fmt(s.sums.peak_kl),
                f"{fmt(s.sums.mean('tv_low'))}–{fmt(s.sums.mean('tv_high'))}",
                fmt(s.sums.mean("overlap")),
                fmt(s.sums.mean("top1")),
                fmt(s.sums.every_position("top1", low=True)),
                fmt(s.sums.mean("entropy_gap")),
                ", ".join(c.name for c in s.causes) or "no gap",
            ]
        )
    return head, rows


def cause_lines(result: DistributionResult) -> list[str]:
    out = []
    for c in result.causes:
        steps = result.cause_steps.get(c.name)
        where = (
            f" (step{'s' if steps and len(steps) > 1 else ''} {', '.join(map(str, steps))})" if steps else ""
        )
        out.append(f"**{c.name}**{where}: " + "; ".join(c.evidence))
        out += [f"  fix: {f}" for f in c.fix]
    return out


def sections(result: DistributionResult, verl_dp: dict[Scalar, float], images: dict[str, str]) -> list[Any]:
    from rl_msprobe.triage.report import Section

    if not result.present:
        return []
    text = [
        f"At every response position, the rollout's top-{result.k} token ids and log-probs against the training "
        "engine's full-vocabulary log-softmax at the same position (after its temperature). KL(rollout ‖ train) is "
        "a lower bound (the top-k ids plus the rest as one token); TV lies between the two bounds given; top-k "
        "overlap: the share of the rollout's top-k ids in the training engine's top-k; top-1: both sides' most "
        "likely token is the same; entropy gap: rollout − train entropy on the rollout's top-k ids.",
    ]
    if result.bad:
        text.append(
            f"{len(result.bad)} line(s) with a distribution could not be read: {'; '.join(result.bad[:3])}"
        )
    out = [
        Section("Distribution per position", text, step_table(result, verl_dp), images.get("kl_by_position"))
    ]
    causes = cause_lines(result) or ["No gap to explain."]
    semantic = result.semantic
    lead = (
        [
            f"Semantic cause(s) found: fix the key(s) below before any dump ({', '.join(c.name for c in semantic)})."
        ]
        if semantic
        else ["No semantic cause explains the gap: numerics (a consistency dump finds where)."]
        if result.causes
        else []
    )
    out.append(Section("Semantic causes", lead + causes))
    return out


def plot(result: DistributionResult, plt: Any) -> dict[str, bytes]:
    """KL (lower bound) and top-1 agreement by response position, one line per step."""
    if not result.present or plt is None:
        return {}
    import numpy as np

    from rl_msprobe.triage.report import png_bytes

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for s in result.step_list()[:12]:
        kl = s.sums.by_position("kl_low")
        if not len(kl):
            continue
        xs = np.arange(len(kl))
        axes[0].plot(xs, np.maximum(kl, 1e-12), linewidth=0.8, label=f"step {s.step}")
        axes[1].plot(xs, s.sums.by_position("top1"), linewidth=0.8, label=f"step {s.step}")
    axes[0].set_yscale("log")
    axes[0].set_title("KL(rollout ‖ train) ≥, by position")
    axes[1].set_title("top-1 agreement by position")
    for ax in axes:
        ax.set_xlabel("response position")
        ax.legend(fontsize=7)
    return {"kl_by_position.png": png_bytes(fig, plt)}

"""Semantic causes of a rollout–training gap, named from the numbers before any dump.

Many reported gaps are not kernels: the two sides compute different quantities. Each cause
leaves a shape in the log-probs that numerics do not, and each is tested here on arrays only
(pure functions; the launch script's settings only choose the wording of the fix):

- **temperature on one side only**: at every position the rollout's log-probs of its top-k
  ids are ``a`` × the training engine's plus a per-position constant (both are log-softmaxes of
  the same logits, one divided by T): the slope ``a`` = T_train / T_rollout, fitted within
  positions; named when it is away from 1 and explains the within-position spread;
- **processed versus raw log-probs (renormalisation)**: slope 1 and a per-position constant
  that is positive at (nearly) every position: the rollout's distribution was renormalised
  over the tokens its top-p / top-k kept (vLLM ``logprobs_mode=processed_logprobs``), so its
  log-probs are larger by −log(kept mass); masked tokens come back as −inf;
- **off-by-one position shift**: the rollout's log-prob at position i matches the training
  engine's at i±1 far better than at i;
- **different prompt or chat template**: the prompt (or response) token ids the rollout server
  saw are not the ones the trainer scored.

"numerics" is the verdict only when none of them explains the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rl_msprobe.triage.distribution import Request

SLOPE_TOL = 0.03  # |a - 1| below this: no temperature (T ratios 0.97 .. 1.03 are not named)
EXPLAINED = 0.8  # the fitted slope removes at least this share of the slope-1 residual
MIN_POSITIONS = 8  # positions with two or more finite pairs before a fit is trusted
OFFSET_SHARE = 0.9  # share of positions whose offset is positive for a renormalisation
OFFSET_SIGNAL = 5.0  # mean offset at least this many times the within-position residual rms
SHIFT_GAIN = 4.0  # a shift's gap at least this many times smaller than the unshifted one
MIN_GAP = 1e-3  # mean |Δ log p| below this: nothing to explain


@dataclass
class Evidence:
    """Running sums over the requests of a step (or a run), enough for every test below."""

    # within-position fit of rollout = a * train + c_i over the rollout's finite top-k ids
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0
    pairs: int = 0
    fit_positions: int = 0
    # per-position offsets at slope 1
    offsets: int = 0
    offset_sum: float = 0.0
    offset_positive: int = 0
    offset_min: float = math.inf
    # tokens the rollout masked out (-inf) although the training engine gives them mass
    masked: int = 0
    masked_positions: int = 0
    # offset versus -log(the training engine's mass on the ids the rollout kept), where all masked
    kept_err: float = 0.0
    kept_n: int = 0
    # sampled-token gaps at shifts -1, 0, +1
    shift_sum: dict[int, float] = field(default_factory=lambda: {-1: 0.0, 0: 0.0, 1: 0.0})
    shift_n: dict[int, int] = field(default_factory=lambda: {-1: 0, 0: 0, 1: 0})
    # token ids: requests whose rollout prompt / response ids differ from the trainer's
    requests: int = 0
    prompt_differs: int = 0
    response_differs: int = 0
    first_difference: str | None = None

    def merge(self, other: Evidence) -> None:
        for name in (
            "sxx",
            "sxy",
            "syy",
            "pairs",
            "fit_positions",
            "offsets",
            "offset_sum",
            "offset_positive",
            "masked",
            "masked_positions",
            "kept_err",
            "kept_n",
            "requests",
            "prompt_differs",
            "response_differs",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.offset_min = min(self.offset_min, other.offset_min)
        for s in self.shift_sum:
            self.shift_sum[s] += other.shift_sum[s]
            self.shift_n[s] += other.shift_n[s]
        self.first_difference = self.first_difference or other.first_difference

    # ------------------------------------------------------------------ derived numbers

    @property
    def slope(self) -> float:
        return self.sxy / self.sxx if self.sxx > 0 else math.nan

    def residual(self, slope: float) -> float:
        """rms of rollout − (slope × train + c_i) within positions."""
        if not self.pairs:
            return math.nan
        ss = self.syy - 2 * slope * self.sxy + slope * slope * self.sxx
        return math.sqrt(max(ss, 0.0) / self.pairs)

    @property
    def mean_offset(self) -> float:
        return self.offset_sum / self.offsets if self.offsets else math.nan

    def shift_gap(self, s: int) -> float:
        return self.shift_sum[s] / self.shift_n[s] if self.shift_n[s] else math.nan


def request_evidence(
    req: Request | None,
    rollout_lp: Any,
    train_lp: Any,
    prompt_ids: list[int] | None = None,
    rollout_prompt_ids: list[int] | None = None,
    response_ids: list[int] | None = None,
    rollout_response_ids: list[int] | None = None,
) -> Evidence:
    """The Evidence of one request: its distribution (may be None), the sampled token's log-probs
    on both sides (float [n]) and, where the rollout server's ids were kept, both sides' ids."""
    ev = Evidence(requests=1)
    if req is not None and req.positions:
        _fit(ev, req)
    lr = np.asarray(rollout_lp, float)
    lt = np.asarray(train_lp, float)
    n = min(len(lr), len(lt))
    lr, lt = lr[:n], lt[:n]
    for s in (-1, 0, 1):
        a = lr[max(0, -s) : n - max(0, s)]
        b = lt[max(0, s) : n - max(0, -s) if s < 0 else n]
        m = min(len(a), len(b))
        d = np.abs(a[:m] - b[:m])
        d = d[np.isfinite(d)]
        ev.shift_sum[s] += float(d.sum())
        ev.shift_n[s] += len(d)
    if (
        rollout_prompt_ids is not None
        and prompt_ids is not None
        and list(rollout_prompt_ids) != list(prompt_ids)
    ):
        ev.prompt_differs = 1
        ev.first_difference = _first_difference("prompt", rollout_prompt_ids, prompt_ids)
    if (
        rollout_response_ids is not None
        and response_ids is not None
        and list(rollout_response_ids) != list(response_ids)
    ):
        ev.response_differs = 1
        ev.first_difference = ev.first_difference or _first_difference(
            "response", rollout_response_ids, response_ids
        )
    return ev


def _first_difference(what: str, rollout: list[int], train: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(rollout, train)) if a != b), min(len(rollout), len(train)))
    return (
        f"{what} ids differ first at index {at}: rollout {list(rollout[at : at + 4])} vs training "
        f"{list(train[at : at + 4])} (lengths {len(rollout)} / {len(train)})"
    )


def _fit(ev: Evidence, req: Request) -> None:
    lr, lt = req.rollout, req.train_at_rollout
    ok = (req.rollout_ids >= 0) & np.isfinite(lr) & np.isfinite(lt)
    masked = (req.rollout_ids >= 0) & np.isneginf(lr) & np.isfinite(lt)
    ev.masked += int(masked.sum())
    ev.masked_positions += int(masked.any(axis=1).sum())
    count = ok.sum(axis=1)
    use = count >= 2
    if not use.any():
        return
    cnt = np.maximum(count, 1)
    mean_r = np.where(ok, lr, 0.0).sum(axis=1) / cnt
    mean_t = np.where(ok, lt, 0.0).sum(axis=1) / cnt
    x = np.where(ok & use[:, None], lt - mean_t[:, None], 0.0)
    y = np.where(ok & use[:, None], lr - mean_r[:, None], 0.0)
    ev.sxx += float((x * x).sum())
    ev.sxy += float((x * y).sum())
    ev.syy += float((y * y).sum())
    ev.pairs += int(count[use].sum())
    ev.fit_positions += int(use.sum())
    offsets = (mean_r - mean_t)[use]
    ev.offsets += len(offsets)
    ev.offset_sum += float(offsets.sum())
    ev.offset_positive += int((offsets > 0).sum())
    ev.offset_min = min(ev.offset_min, float(offsets.min()))
    # where the rollout listed masked ids, all it kept is in its top-k: offset = -log(kept mass)
    full = use & masked.any(axis=1)
    if full.any():
        with np.errstate(divide="ignore"):
            kept = np.log(np.where(ok, np.exp(np.where(ok, lt, -np.inf)), 0.0).sum(axis=1))
        err = np.abs((mean_r - mean_t) + kept)[full]
        ev.kept_err += float(err.sum())
        ev.kept_n += int(full.sum())


@dataclass
class Cause:
    name: str  # temperature | renormalisation | position shift | token ids | numerics
    evidence: list[str]
    fix: list[str]  # verl / engine keys (or the code site) that fix it
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def semantic(self) -> bool:
        return self.name != "numerics"

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.name,
            "semantic": self.semantic,
            "evidence": self.evidence,
            "fix": self.fix,
            "numbers": {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in self.numbers.items()
            },
        }


R = "actor_rollout_ref.rollout."


def diagnose(ev: Evidence, settings: dict[str, str] | None = None) -> list[Cause]:
    """The causes the evidence shows, semantic first; [numerics] when none does and there is a gap;
    [] when there is no gap to explain. SETTINGS: the launch script's rollout keys (without the
    ``actor_rollout_ref.rollout.`` prefix), for the wording of the fix."""
    settings = settings or {}
    causes: list[Cause] = []
    gap0 = ev.shift_gap(0)
    tokens = _ids_cause(ev)
    if tokens:
        causes.append(tokens)
    shift = _shift_cause(ev, gap0)
    if shift:
        causes.append(shift)
    slope = ev.slope
    fitted = ev.fit_positions >= MIN_POSITIONS and math.isfinite(slope)
    r1, ra = ev.residual(1.0), ev.residual(slope) if fitted else math.nan
    if fitted and abs(slope - 1) >= SLOPE_TOL and r1 > 0 and ra <= (1 - EXPLAINED) * r1:
        causes.append(_temperature(ev, slope, r1, ra, settings))
    elif fitted and _renormalised(ev, r1):
        causes.append(_renormalisation(ev, r1, settings))
    if causes:
        return causes
    spread = ev.residual(1.0)
    if (math.isfinite(gap0) and gap0 > MIN_GAP) or (math.isfinite(spread) and spread > MIN_GAP):
        text = [f"mean |Δ log p| of the sampled token {gap0:.3g}"]
        if fitted:
            text.append(
                f"rollout vs training log-probs of the rollout's top-k ids: slope {slope:.4f} (1 ± {SLOPE_TOL} is "
                f"no temperature), per-position offset mean {ev.mean_offset:.3g} with "
                f"{ev.offset_positive}/{ev.offsets} positive (not a renormalisation), residual rms {r1:.3g}"
            )
        text.append("no position shift and the same token ids on both sides (where kept)")
        causes.append(
            Cause(
                "numerics",
                text,
                ["a consistency dump of the worst request finds the first module that differs"],
                {"slope": slope, "gap": gap0, "residual": r1},
            )
        )
    return causes


def _renormalised(ev: Evidence, r1: float) -> bool:
    if not ev.offsets or abs(ev.slope - 1) >= SLOPE_TOL:
        return False
    mean = ev.mean_offset
    return (
        mean > MIN_GAP
        and ev.offset_positive >= OFFSET_SHARE * ev.offsets
        and (not math.isfinite(r1) or mean >= OFFSET_SIGNAL * r1)
    )


def _temperature(ev: Evidence, slope: float, r1: float, ra: float, settings: dict[str, str]) -> Cause:
    ratio = 1.0 / slope  # T_rollout / T_train
    sharper = "rollout" if slope > 1 else "training"
    temp = settings.get("temperature")
    mode = settings.get("logprobs_mode")
    evidence = [
        f"at each of {ev.fit_positions} positions the rollout's log-probs of its top-k ids are {slope:.4f} × the "
        f"training engine's + a per-position constant (residual rms {ra:.3g}, against {r1:.3g} at slope 1)",
        f"T_rollout / T_train = {ratio:.3f}: the {sharper} side's distribution is the sharper one",
    ]
    fix = [
        f"{R}temperature: the trainer divides its logits by it (verl passes it as meta_info['temperature']); "
        f"both sides must apply the same T{' (the script sets ' + temp + ')' if temp else ''}"
    ]
    if mode and mode.startswith("raw"):
        fix.insert(
            0,
            f"{R}logprobs_mode=processed_logprobs: the script asks vLLM for {mode} (before temperature) while "
            "the trainer applies the temperature",
        )
    elif abs(ratio - 1) >= SLOPE_TOL:
        fix.append(
            f"{R}logprobs_mode (vLLM: processed_logprobs = after temperature, raw_logprobs = before); SGLang "
            "returns log-probs after temperature only with RETURN_ORIGINAL_LOGPROB unset"
        )
    return Cause(
        "temperature",
        evidence,
        fix,
        {"slope": slope, "t_rollout_over_t_train": ratio, "residual": ra, "residual_slope_1": r1},
    )


def _renormalisation(ev: Evidence, r1: float, settings: dict[str, str]) -> Cause:
    mean = ev.mean_offset
    evidence = [
        f"slope {ev.slope:.4f} and a per-position offset > 0 at {ev.offset_positive}/{ev.offsets} positions "
        f"(mean {mean:.3g} nats = −log of a kept mass {math.exp(-mean):.3f}; residual rms {r1:.3g})",
    ]
    if ev.masked:
        evidence.append(
            f"{ev.masked} top-k token(s) at {ev.masked_positions} position(s) have log-prob −inf in the rollout "
            "but mass in training: masked out by top-p / top-k before the log-probs were taken"
        )
    if ev.kept_n:
        evidence.append(
            f"where all masked tokens are in the top-k, the offset equals −log(the training mass on the kept "
            f"tokens) within {ev.kept_err / ev.kept_n:.3g} nats on average"
        )
    top_p, top_k = settings.get("top_p"), settings.get("top_k")
    temp = settings.get("temperature")
    unit_t = temp is None or _float(temp) == 1.0
    fix = [
        f"{R}logprobs_mode=raw_logprobs (log-probs before top-p / top-k"
        + (")" if unit_t else "; also before temperature: keep it only at temperature 1)"),
        f"or sample without truncation: {R}top_p=1.0 and {R}top_k=-1"
        + (f" (the script sets top_p={top_p})" if top_p else "")
        + (f" (top_k={top_k})" if top_k else ""),
    ]
    return Cause(
        "renormalisation",
        evidence,
        fix,
        {
            "mean_offset": mean,
            "kept_mass": math.exp(-mean),
            "positive_share": ev.offset_positive / ev.offsets,
            "masked_tokens": ev.masked,
            "residual": r1,
        },
    )


def _shift_cause(ev: Evidence, gap0: float) -> Cause | None:
    if not (math.isfinite(gap0) and gap0 > MIN_GAP):
        return None
    best = min((-1, 1), key=lambda s: ev.shift_gap(s) if math.isfinite(ev.shift_gap(s)) else math.inf)
    g = ev.shift_gap(best)
    if not (math.isfinite(g) and g * SHIFT_GAIN <= gap0):
        return None
    side = "next" if best == 1 else "previous"
    return Cause(
        "position shift",
        [
            f"the rollout's log-prob at position i matches the training engine's at position i{best:+d} "
            f"(mean |Δ log p| {g:.3g}) far better than at i ({gap0:.3g}): the training log-probs are read one "
            f"position off ({side} token)"
        ],
        [
            "the trainer's slice of its log-probs to the response (verl: logits[:, -response_length - 1 : -1] "
            "predict the response tokens), or an engine returning prompt log-probs in place of the response's"
        ],
        {"shift": best, "gap_shifted": g, "gap": gap0},
    )


def _ids_cause(ev: Evidence) -> Cause | None:
    if not (ev.prompt_differs or ev.response_differs):
        return None
    text = [
        f"{ev.prompt_differs} of {ev.requests} request(s): the prompt ids the rollout server received are not "
        f"the ones the trainer scored; {ev.response_differs}: the response ids differ"
    ]
    if ev.first_difference:
        text.append(ev.first_difference)
    return Cause(
        "token ids",
        text,
        [
            "one chat template and tokenizer on both sides: the trainer must score the ids the rollout generated "
            "from (verl's agent loop is token-in-token-out; data.apply_chat_template_kwargs, "
            "actor_rollout_ref.model.path's tokenizer and any custom chat_template the same for both)"
        ],
        {"prompt_differs": ev.prompt_differs, "response_differs": ev.response_differs},
    )


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None

"""The distribution metrics and the semantic causes on synthetic arrays built to have each cause,
and near misses that must not be named (numerics, a 1% logit scale, small noise)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rl_msprobe.triage.distribution import Request, Sums, parse, position_metrics
from rl_msprobe.triage.semantics import diagnose, request_evidence

V, K, N = 64, 8, 40


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def logits(seed=0, n=N, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (n, V))


def top_p_processed(z, p):
    """vLLM's processed log-probs after top-p: the nucleus renormalised, the rest -inf."""
    lp = log_softmax(z)
    order = np.argsort(-lp, axis=1)
    out = np.full_like(lp, -np.inf)
    for i in range(len(lp)):
        probs = np.exp(lp[i, order[i]])
        keep = order[i, : int(np.searchsorted(np.cumsum(probs), p) + 1)]
        out[i, keep] = lp[i, keep] - np.log(np.exp(lp[i, keep]).sum())
    return out


def make(rollout_lp, train_lp, seed=1):
    """Both sides' full log-probs [n, V] -> (Request, sampled token's log-probs on both sides)."""
    rng = np.random.default_rng(seed)
    rids = np.argsort(-rollout_lp, axis=1, kind="stable")[:, :K]
    tids = np.argsort(-train_lp, axis=1, kind="stable")[:, :K]
    take = np.take_along_axis
    req = Request(rids, take(rollout_lp, rids, 1), take(train_lp, rids, 1), tids, take(train_lp, tids, 1))
    probs = np.exp(rollout_lp)
    sampled = np.array([rng.choice(V, p=p / p.sum()) for p in probs])
    rows = np.arange(len(sampled))
    return req, rollout_lp[rows, sampled], train_lp[rows, sampled]


def causes(rollout_lp, train_lp, settings=None):
    req, lr, lt = make(rollout_lp, train_lp)
    return diagnose(request_evidence(req, lr, lt), settings)


def test_identical_sides_have_zero_kl_full_top1_and_nothing_to_explain():
    lp = log_softmax(logits())
    req, lr, lt = make(lp, lp)
    m = position_metrics(req)
    assert np.allclose(m["kl_low"], 0, atol=1e-12) and np.all(m["top1"] == 1) and np.all(m["overlap"] == 1)
    assert np.allclose(m["tv_low"], 0, atol=1e-12)
    assert diagnose(request_evidence(req, lr, lt)) == []


def test_kl_lower_bound_and_tv_bounds_hold_against_the_full_vocabulary():
    z = logits(2)
    a, b = log_softmax(z), log_softmax(z + np.random.default_rng(3).normal(0, 0.3, z.shape))
    m = position_metrics(make(a, b)[0])
    full_kl = (np.exp(a) * (a - b)).sum(axis=1)
    full_tv = 0.5 * np.abs(np.exp(a) - np.exp(b)).sum(axis=1)
    assert np.all(m["kl_low"] <= full_kl + 1e-12) and np.all(m["kl_low"] > 0)
    assert np.all(m["tv_low"] <= full_tv + 1e-12) and np.all(full_tv <= m["tv_high"] + 1e-12)


def test_numeric_noise_is_numerics_not_a_semantic_cause():
    z = logits(4)
    noisy = z + np.random.default_rng(5).normal(0, 0.05, z.shape)
    found = causes(log_softmax(noisy), log_softmax(z))
    assert [c.name for c in found] == ["numerics"], [c.to_json() for c in found]


def test_a_one_percent_logit_scale_is_numerics_not_temperature():
    """A 1% change of the final norm scales the logits by 1.01: slope 1.01 is inside the tolerance."""
    z = logits(6)
    found = causes(log_softmax(1.01 * z), log_softmax(z))
    assert [c.name for c in found] == ["numerics"], [c.to_json() for c in found]
    assert found[0].numbers["slope"] == pytest.approx(1.01, abs=2e-3)


@pytest.mark.parametrize(("t_rollout", "t_train"), [(0.8, 1.0), (1.0, 0.7), (1.2, 1.0)])
def test_temperature_on_one_side_is_named_with_its_factor(t_rollout, t_train):
    z = logits(7)
    found = causes(log_softmax(z / t_rollout), log_softmax(z / t_train), {"temperature": str(t_rollout)})
    assert found[0].name == "temperature", [c.to_json() for c in found]
    assert found[0].numbers["t_rollout_over_t_train"] == pytest.approx(t_rollout / t_train, rel=1e-6)
    assert any("rollout.temperature" in f for f in found[0].fix)
    assert all(c.name != "numerics" for c in found)


def test_temperature_under_noise_is_still_named():
    z = logits(8)
    noisy = z / 0.8 + np.random.default_rng(9).normal(0, 0.02, z.shape)
    found = causes(log_softmax(noisy), log_softmax(z))
    assert found[0].name == "temperature"
    assert found[0].numbers["t_rollout_over_t_train"] == pytest.approx(0.8, rel=0.02)


def test_raw_logprobs_mode_names_the_mode_key():
    z = logits(10)  # vLLM raw log-probs ignore temperature 0.7 that the trainer applies
    found = causes(
        log_softmax(z), log_softmax(z / 0.7), {"temperature": "0.7", "logprobs_mode": "raw_logprobs"}
    )
    assert found[0].name == "temperature" and "logprobs_mode=processed_logprobs" in found[0].fix[0]


def test_top_p_processed_log_probs_are_named_renormalisation():
    z = logits(11, scale=1.5)  # flat enough that top-p 0.9 keeps more than a handful of tokens
    found = causes(top_p_processed(z, 0.9), log_softmax(z), {"top_p": "0.9"})
    assert found[0].name == "renormalisation", [c.to_json() for c in found]
    kept = found[0].numbers["kept_mass"]
    assert 0.85 < kept < 1.0
    assert any("logprobs_mode=raw_logprobs" in f for f in found[0].fix)
    assert any("top_p=1.0" in f and "0.9" in f for f in found[0].fix)


def test_a_constant_offset_of_both_signs_is_not_renormalisation():
    """Near miss: per-position offsets of either sign (no truncation) are numerics."""
    z = logits(12)
    lp = log_softmax(z)
    shift = np.random.default_rng(13).normal(0, 0.05, (N, 1))  # not log-probs any more: numerics-like
    found = causes(lp + shift, lp)
    assert [c.name for c in found] == ["numerics"], [c.to_json() for c in found]


def test_an_off_by_one_shift_is_named_with_its_direction():
    lp = log_softmax(logits(14, n=N + 1))
    req, lr, lt_full = make(lp, lp)
    shifted = np.roll(lt_full, -1)  # the trainer's value at i is the next token's
    found = diagnose(request_evidence(None, lr[:N], shifted[:N]))
    assert found[0].name == "position shift" and found[0].numbers["shift"] == -1, [c.to_json() for c in found]
    found = diagnose(request_evidence(None, lr[1:], lt_full[:-1]))
    assert found[0].name == "position shift" and found[0].numbers["shift"] == 1


def test_smooth_noise_is_not_a_shift():
    """Near miss: log-probs that vary slowly along the response, with numeric noise."""
    base = -np.linspace(0.5, 1.5, N)
    lr = base + np.random.default_rng(15).normal(0, 0.01, N)
    found = diagnose(request_evidence(None, lr, base))
    assert [c.name for c in found] == ["numerics"]


def test_different_prompt_ids_are_named_token_ids():
    lp = log_softmax(logits(16))
    req, lr, lt = make(lp, lp)
    ev = request_evidence(req, lr, lt, prompt_ids=[1, 2, 3, 9], rollout_prompt_ids=[1, 2, 4, 9])
    found = diagnose(ev)
    assert found[0].name == "token ids" and "index 2" in found[0].evidence[1]
    same = request_evidence(req, lr, lt, prompt_ids=[1, 2, 3], rollout_prompt_ids=[1, 2, 3])
    assert diagnose(same) == []


def test_sums_per_position_and_merging_evidence():
    z = logits(17)
    req, lr, lt = make(log_softmax(z / 0.8), log_softmax(z))
    sums = Sums()
    sums.add(position_metrics(req))
    sums.add(position_metrics(req))
    doc = sums.to_json()
    assert doc["requests"] == 2 and doc["tokens"] == 2 * N and doc["mean_kl_low"] > 0
    a, b = request_evidence(req, lr, lt), request_evidence(req, lr, lt)
    a.merge(b)
    assert a.requests == 2 and a.slope == pytest.approx(1.25, rel=1e-9)


def test_parse_reads_the_line_object_and_names_a_bad_key():
    doc = {
        "k": 2,
        "rollout_ids": [[3, 1], [2, 0]],
        "rollout": [[-0.1, None], [-0.2, -2.0]],
        "train_at_rollout": [[-0.1, -3.0], [-0.2, -2.0]],
        "train_ids": [[3, 1], [2, 0]],
        "train": [[-0.1, -3.0], [-0.2, -2.0]],
        "lse": [1.0, 2.0],
        "entropy": [0.3, None],
    }
    req = parse(doc)
    assert req.positions == 2 and math.isinf(req.rollout[0, 1]) and math.isnan(req.entropy[1])
    m = position_metrics(req)
    assert m["top1"].tolist() == [1.0, 1.0]
    doc["train"] = [[-0.1, "x"]]
    with pytest.raises(ValueError, match=r"distribution.train\[0\]\[1\]"):
        parse(doc)

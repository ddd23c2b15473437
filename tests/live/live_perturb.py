"""Test-only, loaded into the live job's processes (tests/support/live_job.py's worker-module hook):
after the rollout engine's N-th weight sync and every later one, scale one layer's RMSNorm
weight in the vLLM model only, so the rollout and the training engine differ from then on.

RL_MSPROBE_TEST_PLANT_FROM_SYNC=N (1-based; sync 1 loads the weights step 1 samples with),
RL_MSPROBE_TEST_PLANT_LOG=<file>: one line per sync, `sync K planted|clean`.

RL_MSPROBE_TEST_SEMANTIC_PLAN: a JSON object {"<sync>": {...}} of the triage scenarios of issue 46,
each for the step that sync precedes only (the next sync loads the trainer's weights again):
``{"final_norm": 1.01}`` scales the final RMSNorm weight (the logits by 1.01: numerics);
``{"temperature": 0.8}`` multiplies the temperature vLLM's sampler applies (training stays at
verl's 1.0); ``{"top_p": 0.9}`` makes the sampler keep the top-p nucleus (verl's default
``logprobs_mode=processed_logprobs`` then returns renormalised log-probs).
"""

from __future__ import annotations

import dataclasses
import json
import os

LAYER = 1
FACTOR = 4.0
_SYNCS = [0]
_SAMPLER: dict = {"active": {}, "wrapped": False}


def _wrap_sampler(runner) -> None:
    """Once: the sampler's forward sees the sync's temperature / top-p change (test-only)."""
    import torch

    sampler = runner.sampler
    original = sampler.forward

    def forward(logits, sampling_metadata, *args, **kwargs):
        active = _SAMPLER["active"]
        md = sampling_metadata
        if active.get("temperature") and md.temperature is not None:
            md = dataclasses.replace(md, temperature=md.temperature * float(active["temperature"]))
        if active.get("top_p"):
            n = logits.shape[0]
            md = dataclasses.replace(md, top_p=torch.full((n,), float(active["top_p"]), device=logits.device))
        return original(logits, md, *args, **kwargs)

    sampler.forward = forward
    _SAMPLER["wrapped"] = True


def _semantic(worker, sync: int) -> dict:
    plan = json.loads(os.environ.get("RL_MSPROBE_TEST_SEMANTIC_PLAN") or "{}")
    if not plan:
        return {}
    active = plan.get(str(sync), {})
    runner = worker.model_runner
    if not _SAMPLER["wrapped"]:
        _wrap_sampler(runner)
    _SAMPLER["active"] = {k: v for k, v in active.items() if k in ("temperature", "top_p")}
    if active.get("final_norm"):
        runner.model.model.norm.weight.data.mul_(float(active["final_norm"]))
    return active


def after_weight_sync(worker) -> None:
    _SYNCS[0] += 1
    plant = _SYNCS[0] >= int(os.environ.get("RL_MSPROBE_TEST_PLANT_FROM_SYNC", "0") or 0) > 0
    if plant:
        model = worker.model_runner.model
        norm = model.model.layers[LAYER].post_attention_layernorm
        norm.weight.data.mul_(FACTOR)  # a scale is the same on any weight layout vLLM repacks to
    semantic = _semantic(worker, _SYNCS[0])
    log = os.environ.get("RL_MSPROBE_TEST_PLANT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(
                f"sync {_SYNCS[0]} {'planted' if plant else 'clean'} pid {os.getpid()}"
                + (f" semantic {json.dumps(semantic)}" if semantic else "")
                + "\n"
            )

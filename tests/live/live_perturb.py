"""Test-only, loaded into the live job's processes (tests/support/live_job.py's worker-module hook):
after the rollout engine's N-th weight sync and every later one, scale one layer's RMSNorm
weight in the vLLM model only, so the rollout and the training engine differ from then on.

RL_MSPROBE_TEST_PLANT_FROM_SYNC=N (1-based; sync 1 loads the weights step 1 samples with),
RL_MSPROBE_TEST_PLANT_LOG=<file>: one line per sync, `sync K planted|clean`.
"""

from __future__ import annotations

import os

LAYER = 1
FACTOR = 4.0
_SYNCS = [0]


def after_weight_sync(worker) -> None:
    _SYNCS[0] += 1
    plant = _SYNCS[0] >= int(os.environ.get("RL_MSPROBE_TEST_PLANT_FROM_SYNC", "0") or 0) > 0
    if plant:
        model = worker.model_runner.model
        norm = model.model.layers[LAYER].post_attention_layernorm
        norm.weight.data.mul_(FACTOR)  # a scale is the same on any weight layout vLLM repacks to
    log = os.environ.get("RL_MSPROBE_TEST_PLANT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"sync {_SYNCS[0]} {'planted' if plant else 'clean'} pid {os.getpid()}\n")

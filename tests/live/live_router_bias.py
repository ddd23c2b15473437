"""Test-only, loaded into the live job's processes (tests/support/live_job.py's worker-module hook):
from the rollout engine's N-th weight sync on, add a bias to ONE expert's router logit in ONE
layer of the vLLM model only, so that layer's top-k expert sets differ from the trainer's.

The gate's forward is wrapped once, as an instance attribute (vLLM CPU's gate is a linear
layer whose weight it may repack: the output is changed, not the weight); rl-msprobe's gate hook
(verl-routing) runs after forward, so it records the biased logits, as it would a real fault.

RL_MSPROBE_TEST_BIAS_FROM_SYNC=N (1-based; sync 1 loads the weights step 1 samples with),
RL_MSPROBE_TEST_BIAS_LOG=<file>: one line per sync, `sync K biased|clean`.
"""

from __future__ import annotations

import os

LAYER = 0  # the layer whose routing agrees at the clean step (see tests/live/test_live_routing.py)
EXPERT = 3
BIAS = 1.0  # the tiny model's router margins are ~0.01-0.2: most tokens of the layer flip
_STATE = {"syncs": 0, "on": False, "wrapped": False}


def _wrap(gate) -> None:
    original = gate.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if not _STATE["on"]:
            return out
        logits = out[0] if isinstance(out, tuple) else out
        logits = logits.clone()
        logits[..., EXPERT] += BIAS
        return (logits, *out[1:]) if isinstance(out, tuple) else logits

    gate.forward = forward


def after_weight_sync(worker) -> None:
    _STATE["syncs"] += 1
    start = int(os.environ.get("RL_MSPROBE_TEST_BIAS_FROM_SYNC", "0") or 0)
    _STATE["on"] = start > 0 and _STATE["syncs"] >= start
    if not _STATE["wrapped"]:
        _wrap(worker.model_runner.model.model.layers[LAYER].mlp.gate)
        _STATE["wrapped"] = True
    log = os.environ.get("RL_MSPROBE_TEST_BIAS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"sync {_STATE['syncs']} {'biased' if _STATE['on'] else 'clean'} pid {os.getpid()}\n")

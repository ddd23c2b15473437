"""The triage top-k on the REAL verl FSDP engine's log-prob forward, for its cost (issue 46).

Run by benchmarks/bench_triage_topk.py with the job venv's python, in a fresh process, the
verl-triage-patched verl copy first on PYTHONPATH; reuses the engine, model and batch of
verl_records_scenario.py (beside it). Imports nothing from rl-msprobe.

    python verl_topk_scenario.py SPEC_JSON      # prints one JSON line prefixed RESULT:

SPEC: {"workdir": DIR, "repeat": N, "k": K, "vocab": V, "hidden": H, "layers": L, "scale": S}
The batch carries the rollout's top-k ids as verl-triage sends them (`rl_msprobe_rollout_topk_ids`,
[samples, response, k]) and `calculate_entropy=True` as verl's old-log-prob call sets; each round
runs forward_backward_batch(forward_only=True) with RL_MSPROBE_TRIAGE_TOPK unset, then set.
Result: seconds per mode, the tokens, and the training-side rows' shape of the last call.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from verl_records_scenario import _batch, _engine, _loss, _samples


def main() -> int:
    spec = json.loads(sys.argv[1])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(spec['workdir'], 'pg-rendezvous')}", rank=0, world_size=1
    )
    from verl.utils import rl_msprobe_triage as helper
    from verl.utils import tensordict_utils as tu

    model = {k: spec[k] for k in ("vocab", "hidden", "layers")}
    engine = _engine("actor", **model)
    from verl.utils import torch_functional as verl_F

    engine.compute_entropy_from_logits = (
        verl_F.entropy_from_logits
    )  # what __init__ sets (no torch.compile here)
    samples = _samples(0, spec["scale"], model["vocab"])
    batch = _batch(samples, True, False)
    tu.assign_non_tensor(batch, calculate_entropy=True)
    k, width = spec["k"], max(len(s["response"]) for s in samples)
    ids = torch.full((len(samples), width, k), -1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(1)
    for i, s in enumerate(samples):
        ids[i, : len(s["response"])] = torch.randint(
            0, model["vocab"], (len(s["response"]), k), generator=gen
        )
    batch[helper.IDS_KEY] = ids
    times: dict = {"off": [], "on": []}
    rows = None
    with torch.no_grad():
        for round_ in range(1 + spec["repeat"]):
            for mode in times:
                os.environ.pop(helper.TOPK_ENV, None)
                if mode == "on":
                    os.environ[helper.TOPK_ENV] = str(k)
                start = time.perf_counter()
                out = engine.forward_backward_batch(batch.clone(), loss_function=_loss, forward_only=True)
                if round_:
                    times[mode].append(time.perf_counter() - start)
                if mode == "on":
                    got = out["model_output"].get(helper.OUT_KEY)
                    rows = None if got is None else [list(t.shape) for t in got.unbind()]
    tokens = sum(len(s["prompt"]) + len(s["response"]) for s in samples)
    responses = sum(len(s["response"]) for s in samples)
    print("RESULT:" + json.dumps({"seconds": times, "tokens": tokens, "responses": responses, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

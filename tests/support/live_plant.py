"""Test-only: perturb chosen module OUTPUTS of the ROLLOUT model, per weight sync (i.e. per step).

Copied into a live job's ``pythonpath/`` and named in ``worker_modules`` (tests/support/live_job.py),
so it is imported in every verl process; ``after_weight_sync(worker)`` runs in each vLLM worker
(each TP rank) after each weight sync. Weight sync k precedes the rollout of training step k, so a
plan keyed by sync number plants a fault at one step and leaves the others clean.

vLLM CPU repacks linear weights after loading (their ``.weight`` has shape [0]), so the output is
scaled, not the weight: the module's ``forward`` is wrapped once, as an instance attribute; msprobe's
module hooks run around ``forward`` (nn.Module.__call__), so the dump records the perturbed output
and everything downstream sees it, as it would a real fault.

``RL_MSPROBE_PLANT`` holds the plan, a JSON list of
``{"sync": K, "module": "model.layers.0.mlp.down_proj", "scale": 1.01, "tp_rank": null}``
(``tp_rank`` N: only that tensor-parallel rank's output, i.e. one shard of a column-parallel
module; ``"phase": "decode"``: only in one-token forwards, the decode steps; ``"prefill"``: only in
forwards of several tokens, the prefill; absent: every forward). ``RL_MSPROBE_PLANT_LOG`` gets one JSON line per sync and rank: what is active.
"""

import json
import os

PLAN_VAR = "RL_MSPROBE_PLANT"
LOG_VAR = "RL_MSPROBE_PLANT_LOG"
_STATE = {"syncs": 0, "active": {}, "wrapped": set()}


def plan() -> list:
    return json.loads(os.environ.get(PLAN_VAR) or "[]")


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group: a single rank
        return 0


def _scaled(output, scale):
    if isinstance(output, tuple) and output:
        return (output[0] * scale, *output[1:])
    return output * scale


def _wrap(module, name: str) -> None:
    original = module.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        active = _STATE["active"].get(name)
        if active is None:
            return out
        scale, phase = active
        first = out[0] if isinstance(out, tuple) else out
        tokens = int(first.shape[0]) if first.dim() > 1 else 1
        if (phase == "decode" and tokens != 1) or (phase == "prefill" and tokens == 1):
            return out
        return _scaled(out, scale)

    module.forward = forward
    _STATE["wrapped"].add(name)


def after_weight_sync(worker) -> None:
    _STATE["syncs"] += 1
    sync, rank = _STATE["syncs"], _tp_rank()
    modules = dict(worker.model_runner.model.named_modules())
    active = {}
    for item in plan():
        name = item["module"]
        if name not in modules:
            raise KeyError(f"{PLAN_VAR}: no module {name!r} in the rollout model")
        if name not in _STATE["wrapped"]:
            _wrap(modules[name], name)
        if item["sync"] == sync and item.get("tp_rank") in (None, rank):
            active[name] = (float(item["scale"]), item.get("phase"))
    _STATE["active"] = active
    log = os.environ.get(LOG_VAR)
    if log:
        with open(log, "a") as handle:
            line = {
                "pid": os.getpid(),
                "sync": sync,
                "tp_rank": rank,
                "active": {k: v[0] for k, v in active.items()},
            }
            line["phases"] = {k: v[1] for k, v in active.items()}
            handle.write(json.dumps(line) + "\n")

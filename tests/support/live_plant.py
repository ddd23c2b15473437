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
module; ``"phase": "decode"``: only the rows of response positions, whatever else the forward
holds; ``"prefill"``: only the rows of prompt positions; ``"batched"``: every row of a forward that
holds two requests or more, none of a forward of one request, the kind of fault a kernel whose
result depends on the batch makes; absent: every row; ``"op": "silu"``: not the module's output but
the output of ``torch.nn.functional.silu`` called inside the module's forward, every row: an
operator inside the module computes differently, what the zoom must name). Rows are told apart from the V1 runner's
own batch (``query_start_loc``, ``num_computed_tokens_cpu``, ``num_prompt_tokens``), as the runner
laid them out, so a batched step with prefill and decode rows is planted row by row.
``RL_MSPROBE_PLANT_LOG`` gets one JSON line per sync and rank: what is active, and when.
"""

import json
import os
import time

PLAN_VAR = "RL_MSPROBE_PLANT"
LOG_VAR = "RL_MSPROBE_PLANT_LOG"
_STATE = {"syncs": 0, "active": {}, "wrapped": set(), "runner": None}
_OP = {"silu": None}  # the scale of the planted operator while a planted module's forward runs


def _plant_operators() -> None:
    """``torch.nn.functional.silu`` replaced when this module is imported (process start), before
    msprobe wraps torch's API: msprobe's wrapper then calls this one, dumps it as one
    ``Functional.silu`` call (the multiplication inside is an inner call, not dumped), and the call's
    input agrees with the training side's while its output does not, as a differing kernel's would."""
    try:
        import torch.nn.functional as F
    except ImportError:  # a process without torch plants nothing
        return
    original = F.silu

    def silu(input, inplace=False):
        out = original(input, inplace=inplace)
        scale = _OP["silu"]
        return out if scale is None else out * scale

    F.silu = silu


_plant_operators()


def plan() -> list:
    return json.loads(os.environ.get(PLAN_VAR) or "[]")


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group: a single rank
        return 0


def _row_mask(rows: int, phase: str):
    """Which of the forward's ROWS the plant scales (module doc), from the runner's batch; None: all."""
    import torch

    runner = _STATE["runner"]
    batch = getattr(runner, "input_batch", None)
    if phase is None or batch is None:
        return None
    n = int(batch.num_reqs)
    if phase == "batched":
        return torch.full((rows,), n >= 2)
    starts = runner.query_start_loc.np[: n + 1]
    mask = torch.zeros(rows, dtype=torch.bool)
    for i in range(n):
        computed, prompt = int(batch.num_computed_tokens_cpu[i]), int(batch.num_prompt_tokens[i])
        for row in range(int(starts[i]), min(int(starts[i + 1]), rows)):
            in_prompt = computed + row - int(starts[i]) < prompt
            mask[row] = in_prompt if phase == "prefill" else not in_prompt
    return mask


def _scaled_rows(value, scale: float, mask):
    if mask is None:
        return value * scale
    factor = 1.0 + (scale - 1.0) * mask.to(value.dtype).reshape(-1, *([1] * (value.dim() - 1)))
    return value * factor


def _wrap(module, name: str) -> None:
    original = module.forward

    def forward(*args, **kwargs):
        active = _STATE["active"].get(name)
        if active is not None and active[2]:  # an operator inside: active while the forward runs
            _OP[active[2]] = active[0]
            try:
                return original(*args, **kwargs)
            finally:
                _OP[active[2]] = None
        out = original(*args, **kwargs)
        if active is None:
            return out
        scale, phase, _ = active
        first = out[0] if isinstance(out, tuple) else out
        mask = _row_mask(int(first.shape[0]), phase) if first.dim() > 1 else None
        scaled = _scaled_rows(first, scale, mask)
        return (scaled, *out[1:]) if isinstance(out, tuple) else scaled

    module.forward = forward
    _STATE["wrapped"].add(name)


def after_weight_sync(worker) -> None:
    _STATE["syncs"] += 1
    sync, rank = _STATE["syncs"], _tp_rank()
    _STATE["runner"] = worker.model_runner
    modules = dict(worker.model_runner.model.named_modules())
    active = {}
    for item in plan():
        name = item["module"]
        if name not in modules:
            raise KeyError(f"{PLAN_VAR}: no module {name!r} in the rollout model")
        if name not in _STATE["wrapped"]:
            _wrap(modules[name], name)
        if item["sync"] == sync and item.get("tp_rank") in (None, rank):
            op = item.get("op")
            if op not in (None, *_OP):
                raise KeyError(f"{PLAN_VAR}: no planted operator {op!r} (known: {sorted(_OP)})")
            active[name] = (float(item["scale"]), item.get("phase"), op)
    _STATE["active"] = active
    log = os.environ.get(LOG_VAR)
    if log:
        with open(log, "a") as handle:
            line = {
                "pid": os.getpid(),
                "sync": sync,
                "tp_rank": rank,
                "time": time.time(),
                "active": {k: v[0] for k, v in active.items()},
            }
            line["phases"] = {k: v[1] for k, v in active.items()}
            line["ops"] = {k: v[2] for k, v in active.items() if v[2]}
            handle.write(json.dumps(line) + "\n")

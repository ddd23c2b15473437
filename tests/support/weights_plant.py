"""Test-only weight faults inside a live job's vLLM workers (a worker module of live_cpu_platform).

``RL_MSPROBE_WEIGHTS_PLANT`` is a JSON list of faults, each
``{"sync": N, "stage": "received"|"resident", "name": HF name, "factor": F, "rank": R|null}``
(rank null: every TP rank). At the N-th weight sync of a worker process (counted here):

- ``received``: a transfer fault — the tensor is multiplied by F after it left the actor and
  before the worker extension's ``_update_weights`` runs (the worker's method is wrapped);
- ``resident``: a loader fault — the tensor is multiplied by F inside the engine's load (the
  model's ``load_weights`` is wrapped), after ``_update_weights`` saw it as received;
- ``skip-received``: the tensor never reaches that rank's ``_update_weights`` (a sync that does not
  send it there);
- ``skip-loaded``: received, but the engine's load drops it (a loader that misses a name).

Tensors are replaced by scaled copies, never edited in place. Each applied fault is logged as a
JSON line to ``RL_MSPROBE_WEIGHTS_PLANT_LOG`` (pid, sync, rank, stage, name, shape).
"""

from __future__ import annotations

import json
import os

PLANT_VAR = "RL_MSPROBE_WEIGHTS_PLANT"
LOG_VAR = "RL_MSPROBE_WEIGHTS_PLANT_LOG"

_state = {"sync": 0}


def _faults() -> list[dict]:
    return json.loads(os.environ.get(PLANT_VAR, "[]") or "[]")


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _log(**entry) -> None:
    with open(os.environ[LOG_VAR], "a", encoding="utf-8") as out:
        out.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


def _scaled(weights, fault: dict, sync: int, rank: int):
    for name, tensor in weights:
        if name == fault["name"]:
            _log(sync=sync, rank=rank, stage=fault["stage"], name=name, shape=list(tensor.shape))
            tensor = tensor * fault["factor"]
        yield name, tensor


def _without(weights, fault: dict, sync: int, rank: int):
    for name, tensor in weights:
        if name == fault["name"]:
            _log(sync=sync, rank=rank, stage=fault["stage"], name=name, shape=list(tensor.shape))
            continue
        yield name, tensor


def _change(weights, fault: dict, sync: int, rank: int):
    skip = fault["stage"].startswith("skip-")
    return (_without if skip else _scaled)(weights, fault, sync, rank)


def before_weight_sync(worker) -> None:
    _state["sync"] += 1
    sync, rank = _state["sync"], _tp_rank()
    for fault in _faults():
        if fault["sync"] != sync or fault.get("rank") not in (None, rank):
            continue
        if fault["stage"] in ("received", "skip-received"):
            original = type(worker)._update_weights.__get__(worker)

            def update(weights, *args, _fault=fault, _original=original, **kwargs):
                return _original(list(_change(weights, _fault, sync, rank)), *args, **kwargs)

            worker._update_weights = update
        elif fault["stage"] in ("resident", "skip-loaded"):
            model = worker.model_runner.model
            load = type(model).load_weights.__get__(model)

            def load_weights(weights, *args, _fault=fault, _load=load, **kwargs):
                return _load(_change(weights, _fault, sync, rank), *args, **kwargs)

            model.load_weights = load_weights


def after_weight_sync(worker) -> None:
    worker.__dict__.pop("_update_weights", None)
    worker.model_runner.model.__dict__.pop("load_weights", None)

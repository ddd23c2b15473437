"""Added to this tree by rl-msprobe: MoE router decisions per token, on the rollout and the trainer.

`rl-msprobe patch revert verl-routing` removes this file and every line that calls it.
Active only with ``RL_MSPROBE_TRIAGE=<absolute folder>`` (the triage folder; `rl-msprobe
mismatch report` reads both) and a model with MoE gates; ``RL_MSPROBE_ROUTING=0`` turns it off.

A gate is found by shape, not by class: a module named ``...gate`` whose parent also holds
``experts`` (HF ``Qwen3MoeSparseMoeBlock.gate``, vLLM's ``Qwen3MoeSparseMoeBlock.gate`` /
``GateLinear``, Mixtral/DeepSeek blocks alike), in a ``layers.<N>.`` module. A forward hook
takes the gate's router logits (its output, or the first item of a tuple output: [rows,
experts]), and keeps per row the top-k expert ids (k from the model config's
``num_experts_per_tok``) and the margin between the k-th and the (k+1)-th logit.

- Rollout (vLLM worker, ``rollout(worker)`` at each weight sync; hooks installed once; the eager
  model only: a replayed CUDA graph runs no Python hook, so without ``enforce_eager`` it writes one
  error line instead): every model forward of the V1 runner; its rows are split into requests with the runner's own batch
  (``input_batch.req_ids``, ``query_start_loc``) and the ``positions`` the model was called with.
  One line per request and forward: ``request_id`` (vLLM's, the report strips its suffix),
  ``positions`` (absolute, 0-based in prompt + response), ``tokens`` (the input ids of those rows).
- Trainer (the actor's ``compute_log_prob``: ``begin(worker, data)`` / ``end(token)``): the forwards
  run between them without grad (the old-log-prob recompute, not the update); rows are split into
  sequences by ``attention_mask`` (padded input) or ``position_ids`` restarting at 0 (verl's
  remove-padding input). One line per sequence: ``call`` (the n-th compute_log_prob of this
  process), ``tokens`` (the whole sequence), ``positions``.

Both write ``experts`` (per row, per layer, the k ids, best first) and ``margins`` (per row, per
layer, 6 significant digits) to ``<folder>/<pid>/routing.jsonl``, after one ``header`` line per
process and side: ``layers`` (module names), ``top_k``, ``experts`` (count) and ``replay`` (the
rollout: whether vLLM returns routed experts; the trainer: verl's router-replay mode and whether
the batch carried the rollout's ``routed_experts``). A failure never stops the job: one
``{"error": ...}`` line, printed once.

Depends only on the standard library and torch; never on rl-msprobe.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import traceback
from typing import Any

ENV = "RL_MSPROBE_TRIAGE"
SWITCH = "RL_MSPROBE_ROUTING"
SCHEMA = "rl-msprobe-routing/1"
LOG_NAME = "routing.jsonl"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"warned": False, "calls": 0, "armed": 0}


def folder() -> str | None:
    if os.environ.get(SWITCH, "").strip() == "0":
        return None
    value = os.environ.get(ENV, "").strip()
    return value or None


# ---------------------------------------------------------------------------- entry points


def rollout(worker: Any) -> None:
    """In the vLLM worker (verl's worker extension, each weight sync): hooks on the model, once."""
    if folder() is None:
        return
    try:
        runner = worker.model_runner
        model = runner.model
        if getattr(model, "_rl_msprobe_routing", None) is not None:
            return
        config = getattr(getattr(runner, "model_config", None), "hf_config", None)
        recorder = _Recorder(model, config, "rollout", runner=runner)
        model._rl_msprobe_routing = recorder
        if recorder.gates and not getattr(getattr(runner, "model_config", None), "enforce_eager", True):
            # a captured CUDA graph replays without running Python hooks: no rows would be recorded
            raise RuntimeError(
                "the rollout's MoE routing needs the eager model: set actor_rollout_ref.rollout.enforce_eager=True"
            )
        if recorder.gates:
            recorder.replay = {"return_routed_experts": _returns_routed_experts(runner)}
            recorder.install()
    except Exception as exc:  # routing records must never stop a rollout
        _error("rollout", exc)


def begin(worker: Any, data: Any = None) -> Any:
    """Before the actor's log-prob recompute: hooks on the training model (once), armed for it."""
    if folder() is None:
        return None
    try:
        engine = worker.actor.engine
        model = engine.module
        recorder = getattr(model, "_rl_msprobe_routing", None)
        if recorder is None:
            recorder = _Recorder(model, getattr(model, "config", None), "train")
            model._rl_msprobe_routing = recorder
            if recorder.gates:
                recorder.install()
        if not recorder.gates:
            return None
        keys = _keys(data)
        recorder.replay = {
            "mode": _replay_mode(worker),
            "enabled": bool(getattr(worker, "enable_routing_replay", False)),
            "rollout_experts_in_batch": "routed_experts" in keys,
        }
        _STATE["calls"] += 1
        recorder.call = _STATE["calls"]
        _STATE["armed"] += 1
        return recorder
    except Exception as exc:
        _error("train", exc)
        return None


def end(token: Any) -> None:
    if token is not None:
        _STATE["armed"] = max(0, _STATE["armed"] - 1)


# ---------------------------------------------------------------------------- the recorder


class _Recorder:
    def __init__(self, model: Any, config: Any, side: str, runner: Any = None) -> None:
        self.model, self.side, self.runner = model, side, runner
        self.top_k = _config_int(config, _TOPK_KEYS)
        self.num_experts = _config_int(config, _EXPERT_KEYS)
        self.gates: list[tuple[int, str, Any]] = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
            layer = _LAYER.search(name + ".")
            if leaf == "gate" and parent is not None and hasattr(parent, "experts") and layer:
                self.gates.append((int(layer.group(1)), name, module))
        self.gates.sort(key=lambda g: g[0])
        self.buffer: dict[int, Any] = {}
        self.lists: list | None = None
        self.inputs: dict[str, Any] = {}
        self.replay: dict[str, Any] = {}
        self.call = 0
        self.header_written = False

    def install(self) -> None:
        for layer, _name, module in self.gates:
            module.register_forward_hook(self._gate_hook(layer))
        self.model.register_forward_pre_hook(self._pre, with_kwargs=True)
        self.model.register_forward_hook(self._post)

    def active(self) -> bool:
        if folder() is None:
            return False
        if self.side == "rollout":
            return True
        import torch

        return _STATE["armed"] > 0 and not torch.is_grad_enabled()

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.buffer, self.inputs, self.lists = {}, {}, None
        if not self.active():
            return
        names = ("input_ids", "positions") if self.side == "rollout" else ("input_ids", "position_ids")
        for i, name in enumerate(names):
            value = kwargs.get(name, args[i] if len(args) > i else None)
            self.inputs[name] = value
        self.inputs["attention_mask"] = kwargs.get("attention_mask")

    def _gate_hook(self, layer: int):
        def hook(module: Any, args: tuple, output: Any) -> None:
            if not self.inputs:
                return
            try:
                logits = output[0] if isinstance(output, (tuple, list)) else output
                k = self.top_k or int(getattr(module, "top_k", 0) or 0)
                if k <= 0 or logits.dim() != 2 or logits.shape[-1] <= k:
                    raise ValueError(f"gate of layer {layer}: logits {tuple(logits.shape)} with top-k {k}")
                import torch

                with torch.no_grad():
                    values, ids = torch.topk(logits.detach().float(), k + 1, dim=-1)
                    margin = values[:, k - 1] - values[:, k]
                self.buffer[layer] = (ids[:, :k], margin)  # on the device until the forward ends
            except Exception as exc:
                _error(self.side, exc)

        return hook

    def _post(self, module: Any, args: tuple, output: Any) -> None:
        if not self.inputs or not self.buffer:
            return
        try:
            lines = list(self._rollout_lines() if self.side == "rollout" else self._train_lines())
            if not self.header_written:
                lines.insert(0, json.dumps(self._header()))
                self.header_written = True
            _append(lines)
        except Exception as exc:
            _error(self.side, exc)
        finally:
            self.buffer, self.inputs, self.lists = {}, {}, None

    def _header(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": "header",
            "side": self.side,
            "layers": [name for _layer, name, _m in self.gates],
            "top_k": self.top_k,
            "experts": self.num_experts,
            "replay": self.replay,
        }

    def _per_row(self, rows: list[int]) -> tuple[list, list]:
        if self.lists is None:  # one host copy per forward (all layers stacked), not one per row
            import torch

            layers = sorted(self.buffer)
            ids = torch.stack([self.buffer[k][0] for k in layers]).cpu().tolist()
            gaps = torch.stack([self.buffer[k][1] for k in layers]).cpu().tolist()
            self.lists = list(zip(ids, gaps))
        experts = [[ids[r] for ids, _m in self.lists] for r in rows]
        margins = [[float(f"{m[r]:.6g}") for _ids, m in self.lists] for r in rows]
        return experts, margins

    def _rollout_lines(self):
        positions = _flat_ints(self.inputs.get("positions"))
        tokens = _flat_ints(self.inputs.get("input_ids"))
        batch = getattr(self.runner, "input_batch", None)
        starts = getattr(getattr(self.runner, "query_start_loc", None), "np", None)
        if batch is None or starts is None or positions is None:
            raise ValueError(
                "the vLLM runner's batch (input_batch, query_start_loc) or positions are missing"
            )
        n = int(batch.num_reqs)
        for i in range(n):
            rows = list(range(int(starts[i]), int(starts[i + 1])))
            if not rows:
                continue
            experts, margins = self._per_row(rows)
            yield json.dumps(
                {
                    "schema": SCHEMA,
                    "side": "rollout",
                    "layers": sorted(self.buffer),
                    "request_id": str(batch.req_ids[i]),
                    "positions": [positions[r] for r in rows],
                    "tokens": [tokens[r] for r in rows] if tokens is not None else None,
                    "experts": experts,
                    "margins": margins,
                }
            )

    def _train_lines(self):
        ids = self.inputs.get("input_ids")
        if ids is None:
            raise ValueError("the training model was called without input_ids")
        width = int(ids.shape[-1])
        flat = _flat_ints(ids)
        mask = self.inputs.get("attention_mask")
        if (
            mask is not None
            and getattr(mask, "dim", lambda: 0)() == 2
            and tuple(mask.shape) == tuple(ids.shape)
        ):
            m = _flat_ints(mask)
            groups = [
                [b * width + j for j in range(width) if m[b * width + j]] for b in range(int(ids.shape[0]))
            ]
        else:
            pos = self.inputs.get("position_ids")
            p = _flat_ints(pos[..., :] if pos is not None and pos.dim() <= 2 else None)
            if p is None or len(p) != len(flat):
                p = list(range(len(flat)))
            groups, current = [], []
            for r, q in enumerate(p):
                if q == 0 and current:
                    groups.append(current)
                    current = []
                current.append(r)
            if current:
                groups.append(current)
        for rows in groups:
            experts, margins = self._per_row(rows)
            yield json.dumps(
                {
                    "schema": SCHEMA,
                    "side": "train",
                    "layers": sorted(self.buffer),
                    "call": self.call,
                    "tokens": [flat[r] for r in rows],
                    "positions": list(range(len(rows))),
                    "experts": experts,
                    "margins": margins,
                }
            )


# ---------------------------------------------------------------------------- small helpers


def _append(lines: list[str]) -> None:
    where = folder()
    if where is None or not lines:
        return
    path = os.path.join(where, str(os.getpid()), LOG_NAME)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _LOCK, open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def _error(side: str, exc: BaseException) -> None:
    _append([json.dumps({"schema": SCHEMA, "side": side, "error": f"{type(exc).__name__}: {exc}"})])
    if not _STATE["warned"]:
        _STATE["warned"] = True
        print(f"rl-msprobe routing ({side}): {traceback.format_exc()}", file=sys.stderr)


def _config_int(config: Any, keys: tuple[str, ...]) -> int | None:
    for source in (config, getattr(config, "text_config", None)):
        for key in keys:
            value = getattr(source, key, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def _flat_ints(value: Any) -> list[int] | None:
    if value is None:
        return None
    return [int(v) for v in value.reshape(-1).tolist()]


def _keys(data: Any) -> set:
    try:
        return set(data.keys()) if data is not None else set()
    except Exception:
        return set()


def _replay_mode(worker: Any) -> str:
    actor = getattr(getattr(worker, "config", None), "actor", None)
    strategy = getattr(actor, "strategy", None)
    engine = getattr(actor, str(strategy), None) if strategy else None
    mode = getattr(getattr(engine, "router_replay", None), "mode", None)
    return str(mode) if mode is not None else "none"


def _returns_routed_experts(runner: Any) -> bool:
    config = getattr(runner, "vllm_config", None)
    for holder in (getattr(config, "aux_output_config", None), getattr(runner, "model_config", None)):
        value = getattr(holder, "enable_return_routed_experts", None)
        if value is not None:
            return bool(value)
    return False

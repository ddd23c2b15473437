"""msprobe dump hooks and per-token records for verl's training engines. Added to this tree by
rl-msprobe (patch set verl-engine, with `rl_msprobe_records.py` beside it).

The engine files call these functions from a few marked lines (`# rl-msprobe:...`); run
`rl-msprobe patch revert verl-engine --tree <this tree>` to remove them and these files.

Environment (read at every call, so a Ray worker sees what its runtime env gives it):
  RL_MSPROBE_RECORD_DIR=DIR per-token records (rl-msprobe's docs/records.md, "rl-msprobe-records/1"):
                            the actor's log-prob forward only (forward-only, not the reference
                            model's engine, not a value head), one record per micro-batch holding a
                            selected request (RL_MSPROBE_RECORD_SHARE / _IDS / _LAYERS / _MODULES),
                            in DIR/train/{pid}/rec{K}.f32 + .json. Independent of DUMP_ON: with
                            DUMP_ON unset msprobe is never imported. Rows follow the micro-batch as
                            the engine feeds the model (`fsdp_layout`, `_megatron_recorder`):
                            FSDP packed (use_remove_padding) or padded, any grouping (dynamic
                            batch), Ulysses SP slices (header `sp_rank` / `sp_size`: the reader
                            puts the ranks' rows together); Megatron THD with TP (header
                            `tp_rank` / `tp_size`) and PP (`pp_rank` / `pp_size`, each stage its
                            own layers, named by global layer number). Refused with one
                            RlMsprobeRecordError naming the setting: Megatron sequence parallel,
                            context parallel or bshd (use_remove_padding=False); a vision model
                            under Ulysses SP. With use_fused_kernels the logits are never
                            materialised: the lm_head output is then not in the records.
  DUMP_ON=1                 enable msprobe; unset or anything else: the msprobe hooks do nothing
                            and msprobe is never imported
  DUMP_PHASE=log_prob       which engine calls dump: log_prob (forward-only, the default),
                            update_actor (forward + backward), or all
  PROMPTS_ONLY=1            dump only micro-batches that carry no response tokens: the prompts-only
                            copy the patched trainer runs through the actor just for the dump
                            (rl_msprobe_consistency.prompts_forward); the step's own forwards on the
                            full responses run undumped (and are the ones the records cover)
  MSPROBE_ACTOR_CONFIG=PATH the msprobe config.json for the training side (required when DUMP_ON=1);
                            its `request_id` (a base id): only micro-batches holding that request are
                            dumped, cut to its rows by msprobe's `slice` (`request_slice`)
  DUMP_SEED=1234            seed passed to msprobe's seed_all
  DUMP_DETERMINISTIC=1      seed_all(mode=True) as msprobe documents for precision comparison:
                            it calls torch.use_deterministic_algorithms(True), so a
                            non-deterministic CUDA/NPU kernel then raises. Set 0 to only seed.
  DUMP_POSITIONS=1          (with DUMP_ON=1; the former format, kept for `rl-msprobe dumps positions`
                            until it reads the records above) also record per-token statistics
                            (Max, Min, Norm of each token's row of every module input and output,
                            JSON, every request of the micro-batch) of the actor's log-prob forward
                            over prompt + response, beside msprobe's dump.

Output: one msprobe step per dumped micro-batch in `{dump_path}/step{N}/rank{R}/dump.json`,
and one line per dumped micro-batch in `{dump_path}/{pid}/update_actor_log.jsonl`:
  {"source": "update_actor", "timestamp", "pid", "rank", "step", "phase", "request_ids", "num_requests"}
With DUMP_POSITIONS=1, one file per recorded micro-batch, `{dump_path}/positions/{pid}/forward{K}.json`:
  {"task": "per_token", "pid", "rank", "forward", "timestamp", "request_ids", "tokens", "data": {
   "Module.<name>.<Class>.forward.<n>": {"input_args": [leaf...], "output": [leaf...]}}}
  leaf (tensor): {"type": "torch.Tensor", "dtype", "shape", "Max", "Min", "Norm", "token_axis",
                  "per_token": {"Max": [...], "Min": [...], "Norm": [...]}}; other values: {"type": "other"}
The reference-model engine (`engine_config.forward_only`) is never dumped nor recorded.

This file depends on nothing but the standard library and (lazily) msprobe, torch, verl's own
utilities and rl_msprobe_records (beside it); it never imports rl-msprobe.
"""

from __future__ import annotations

import json
import os
import re
import time

PHASES = ("log_prob", "update_actor", "all")

_state = {"debugger": None, "config": None}


class RlMsprobeConfigError(RuntimeError):
    """DUMP_ON=1 but the msprobe config cannot be used: one clear message, no chained traceback."""


def enabled() -> bool:
    return os.environ.get("DUMP_ON", "") == "1"


def _phase() -> str:
    phase = os.environ.get("DUMP_PHASE", "log_prob").strip() or "log_prob"
    if phase not in PHASES:
        raise RlMsprobeConfigError(f"DUMP_PHASE={phase!r} is not one of {', '.join(PHASES)}.")
    return phase


def wants(engine, forward_only: bool) -> bool:
    """Should this engine call be dumped? (DUMP_ON, DUMP_PHASE, and never the ref engine.)"""
    if not enabled():
        return False
    engine_config = getattr(engine, "engine_config", None)
    if getattr(engine_config, "forward_only", False):
        return False  # the reference model's engine
    phase = _phase()
    if phase == "all":
        return True
    return phase == ("log_prob" if forward_only else "update_actor")


def _empty(value) -> bool:
    if getattr(value, "is_nested", False):
        value = value.values()
    numel = getattr(value, "numel", None)
    return numel is not None and numel() == 0


def wants_batch(batch) -> bool:
    """PROMPTS_ONLY=1: is BATCH the prompts-only copy (its responses / response mask empty)?
    Without PROMPTS_ONLY=1, or when the batch has neither field, every batch is dumped."""
    if os.environ.get("PROMPTS_ONLY", "").strip() != "1" or batch is None:
        return True
    responses = _responses(batch)
    return True if responses is None else _empty(responses)


def _responses(batch):
    """BATCH's `responses` (else `response_mask`) field; None when it has neither."""
    for key in ("responses", "response_mask"):
        try:
            value = batch[key] if key in batch.keys() else None  # noqa: SIM118 (older tensordict refuses `in`)
        except Exception:
            value = None
        if value is not None:
            return value
    return None


def debugger():
    """The process's msprobe PrecisionDebugger (a per-process singleton), created on first use."""
    if _state["debugger"] is not None:
        return _state["debugger"]
    config = os.environ.get("MSPROBE_ACTOR_CONFIG", "")
    if not config:
        raise RlMsprobeConfigError(
            "DUMP_ON=1 but MSPROBE_ACTOR_CONFIG is not set: point it at the training msprobe config.json "
            "(rl-msprobe prepare writes config_actor.json), or unset DUMP_ON."
        ) from None
    try:
        with open(config, encoding="utf-8") as handle:
            json.load(handle)
    except (OSError, ValueError) as exc:
        raise RlMsprobeConfigError(
            f"DUMP_ON=1 but MSPROBE_ACTOR_CONFIG={config} cannot be used ({exc}); fix the file or the variable."
        ) from None
    from msprobe.pytorch import PrecisionDebugger, seed_all

    seed_all(
        seed=int(os.environ.get("DUMP_SEED", "1234")),
        mode=os.environ.get("DUMP_DETERMINISTIC", "1") == "1",
    )
    _state["debugger"] = PrecisionDebugger(config_path=config)
    _state["config"] = config
    return _state["debugger"]


def request_ids(batch) -> list:
    """The micro-batch's request ids, as plain strings (empty when it carries none).

    Looked up as a top-level non-tensor field `request_id` (a TensorDict micro-batch, or a
    DataProto's `non_tensor_batch`), else inside `extra_fields` (verl 0.8.0's main_ppo_sync
    and the v1 trainer keep the rollout's extra fields as one field per sample).
    """
    if batch is None:
        return []
    for source in (getattr(batch, "non_tensor_batch", None), batch):
        if source is None:
            continue
        for key in ("request_id", "request_ids", "extra_fields"):
            try:
                value = source[key] if key in source.keys() else None  # noqa: SIM118 (older tensordict refuses `in`)
            except Exception:
                value = None
            if value is None:
                continue
            items = _as_list(value)
            if key == "extra_fields":
                items = [item.get("request_id") if isinstance(item, dict) else None for item in items]
            found = []
            for item in items:
                for one in item if isinstance(item, (list, tuple)) else [item]:
                    if one is not None:
                        found.append(one.decode() if isinstance(one, bytes) else str(one))
            if found:
                return found
    return []


def _as_list(value) -> list:
    """A non-tensor value (numpy object array, NonTensorData / NonTensorStack, list, str) as a list."""
    if isinstance(value, (str, bytes)):
        return [value]
    if isinstance(value, dict):
        return [value]
    if hasattr(value, "tolist") and not hasattr(value, "is_nested"):
        try:
            listed = value.tolist()
            return list(listed) if isinstance(listed, (list, tuple)) else [listed]
        except (TypeError, ValueError):
            pass
    if hasattr(value, "data") and not isinstance(value, (list, tuple)):
        data = value.data
        return list(data) if isinstance(data, (list, tuple)) else [data]
    if isinstance(value, (list, tuple)):
        return list(value)
    try:
        return list(value)
    except TypeError:
        return [value]


def _rank(engine) -> int:
    rank = getattr(engine, "rank", None)
    if rank is not None:
        return int(rank)
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def _log(engine, batch, step: int, phase: str) -> None:
    dump_path = debugger().service.config.dump_path
    pid = os.getpid()
    folder = os.path.join(dump_path, str(pid))
    os.makedirs(folder, exist_ok=True)
    ids = request_ids(batch)
    line = {
        "source": "update_actor",
        "timestamp": time.time(),
        "pid": pid,
        "rank": _rank(engine),
        "step": step,
        "phase": phase,
        "request_ids": ids,
        "num_requests": len(ids),
    }
    with open(os.path.join(folder, "update_actor_log.jsonl"), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")


def _dumping(service) -> bool:
    """Does msprobe dump the step it just started? Not once it has stopped for good (past the
    config's last `step`), nor on a step or rank the config leaves out."""
    if getattr(service, "should_stop_service", False):
        return False
    config = getattr(service, "config", None)
    steps = getattr(config, "step", None)
    if steps and getattr(service, "current_iter", None) not in steps:
        return False
    ranks = getattr(config, "rank", None)
    return not (ranks and getattr(service, "current_rank", None) not in ranks)


def _start(model):
    """Start msprobe on MODEL; returns its step number when this micro-batch is dumped, else None."""
    dbg = debugger()
    dbg.start(model=model)
    return int(getattr(dbg.service, "current_iter", 0)) if _dumping(dbg.service) else None


def _finish(engine, batch, step, phase: str) -> None:
    """Stop and step msprobe; a micro-batch it did not dump (STEP None) gets no log line, so every
    line names a step{N} that exists."""
    dbg = debugger()
    dbg.stop()
    if step is not None:
        _log(engine, batch, step, phase)
    dbg.step()


# ---------------------------------------------------------------- FSDP engine


def micro_batch_start(engine, micro_batch, forward_only):
    """Before a micro-batch's forward (and backward): start the debugger on engine.module,
    (DUMP_POSITIONS=1) the old per-token recorder on a log-prob forward over responses, and
    (RL_MSPROBE_RECORD_DIR) the per-token records of the selected requests' rows."""
    records = record_start(engine, micro_batch, forward_only)
    if not wants(engine, forward_only):
        return (None, micro_batch, None, None, None, records) if records is not None else None
    recorder = None
    if forward_only and positions_enabled() and _has_responses(micro_batch):
        recorder = PositionRecorder(engine.module, request_ids(micro_batch), _rank(engine))
    if not wants_batch(micro_batch):
        return (None, micro_batch, None, None, recorder, records)
    phase = "log_prob" if forward_only else "update_actor"
    if not _slice_to_request(engine, micro_batch):
        return (None, micro_batch, None, None, recorder, records)
    return (engine, micro_batch, _start(engine.module), phase, recorder, records)


def micro_batch_end(token) -> None:
    """After the micro-batch: stop, log its request ids, step; write the per-token records."""
    if token is None:
        return
    engine, micro_batch, step, phase, recorder, records = token
    if engine is not None:
        _finish(engine, micro_batch, step, phase)
    if recorder is not None:
        recorder.finish()
    if records is not None:
        records.finish()


# ---------------------------------------------------------------- msprobe's per-request slice


def _wanted_request():
    """The training config's `request_id` (its task section), else None."""
    dbg = debugger()
    return getattr(dbg.service.config, "request_id", None) or None


def _slice_to_request(engine, micro_batch) -> bool:
    """With a `request_id` in the config: set msprobe's slice to that request's rows of MICRO_BATCH and
    say whether to dump it (False: the request is not in it). Without one: True, nothing changed."""
    wanted = _wanted_request()
    if wanted is None:
        return True
    found = request_slice(engine, micro_batch, str(wanted))
    debugger().service.config.slice_info = found or []
    return found is not None


def request_slice(engine, micro_batch, wanted: str):
    """msprobe's `slice` for request WANTED's rows of MICRO_BATCH, or None when it is not there.

    Packed (`use_remove_padding`, nested `input_ids`): the model sees [1, total_nnz (+ static pad)];
    the request's rows are dim 1 [offsets[i], offsets[i+1]). Padded ([B, S] with an attention mask):
    dim 0 the sample, dim 1 its attended positions. Ulysses sequence parallelism splits the rows
    over ranks, and is refused."""
    ids = [_base_id(rid) for rid in request_ids(micro_batch)]
    if wanted not in ids:
        return None
    if getattr(engine, "use_ulysses_sp", False):
        raise RlMsprobeConfigError(
            f"MSPROBE_ACTOR_CONFIG sets request_id {wanted}, but Ulysses sequence parallelism splits a sequence's "
            "rows over ranks: msprobe's slice cannot cut one request out. Set ulysses_sequence_parallel_size=1 "
            "for the dumped run, or remove request_id."
        )
    index = ids.index(wanted)
    input_ids = micro_batch["input_ids"]
    if getattr(input_ids, "is_nested", False):
        offsets = [int(x) for x in input_ids.offsets().tolist()]
        total = offsets[-1]
        pad = getattr(engine, "_get_packed_pad_size", None)
        total += int(pad(total) or 0) if callable(pad) else 0
        return [{"dim": 1, "size": total, "begin": offsets[index], "end": offsets[index + 1]}]
    rows, width = int(input_ids.shape[0]), int(input_ids.shape[-1])
    mask = micro_batch["attention_mask"] if "attention_mask" in micro_batch.keys() else None  # noqa: SIM118
    cols = mask[index].nonzero().flatten().tolist() if mask is not None else [0, width - 1]
    return [
        {"dim": 0, "size": rows, "begin": index, "end": index + 1},
        {"dim": 1, "size": width, "begin": int(cols[0]), "end": int(cols[-1]) + 1},
    ]


def _base_id(request_id) -> str:
    """verl's id (the one rule, in rl_msprobe_records.base_id beside this file)."""
    return _records().base_id(request_id)


# ---------------------------------------------------------------- per-token statistics


def positions_enabled() -> bool:
    return os.environ.get("DUMP_POSITIONS", "").strip() == "1"


def _has_responses(batch) -> bool:
    """Does BATCH carry response tokens (not the prompts-only copy, not a batch without the field)?"""
    responses = _responses(batch) if batch is not None else None
    return responses is not None and not _empty(responses)


def _positions_folder() -> str:
    config = os.environ.get("MSPROBE_ACTOR_CONFIG", "")
    try:
        with open(config, encoding="utf-8") as handle:
            dump_path = json.load(handle).get("dump_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise RlMsprobeConfigError(
            f"DUMP_POSITIONS=1 but MSPROBE_ACTOR_CONFIG={config!r} cannot be read ({exc}): point it at the "
            "training msprobe config.json, or unset DUMP_POSITIONS."
        ) from None
    if not isinstance(dump_path, str) or not dump_path:
        raise RlMsprobeConfigError(f"DUMP_POSITIONS=1: {config} sets no dump_path.")
    return os.path.join(dump_path, "positions", str(os.getpid()))


class PositionRecorder:
    """Forward hooks on every submodule of MODEL for one forward: each tensor input / output's
    Max, Min and L2 norm per token (the token axis: its first axis as long as the token ids the
    first integer input, the embedding's, holds). Keys as msprobe names module rows."""

    forwards = 0  # per process: the file number

    def __init__(self, model, request_ids, rank) -> None:
        self.request_ids, self.rank = list(request_ids), rank
        self.tokens = None
        self.data = {}
        self.calls = {}
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._hook(name, type(module).__name__)))

    def _hook(self, name, cls):
        def hook(module, args, output):
            self._record(name, cls, args, output)

        return hook

    def _record(self, name, cls, args, output) -> None:
        import torch

        if self.tokens is None:
            ids = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
            if ids is None or getattr(ids, "is_nested", False):
                return
            self.tokens = int(ids.numel())
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        outputs = output if isinstance(output, (tuple, list)) else [output]
        self.data[f"Module.{name}.{cls}.forward.{n}"] = {
            "input_args": [self._leaf(a) for a in args],
            "output": [self._leaf(o) for o in outputs],
        }

    def _leaf(self, value) -> dict:
        import torch

        if not isinstance(value, torch.Tensor) or getattr(value, "is_nested", False) or value.numel() == 0:
            return {"type": "other"}
        axis = next((i for i, n in enumerate(value.shape) if n == self.tokens), None)
        if axis is None:
            return {"type": "other"}
        with torch.no_grad():
            rows = value.detach().movedim(axis, 0).reshape(self.tokens, -1)
            rows = rows.float() if rows.is_floating_point() else rows.double()
            hi, lo = rows.max(dim=1).values, rows.min(dim=1).values
            norm = rows.float().norm(dim=1) if value.is_floating_point() else torch.zeros_like(hi)
        return {
            "type": "torch.Tensor",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "token_axis": axis,
            "Max": float(hi.max()),
            "Min": float(lo.min()),
            "Norm": float(norm.norm()),
            "per_token": {"Max": hi.tolist(), "Min": lo.tolist(), "Norm": norm.tolist()},
        }

    def finish(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        folder = _positions_folder()
        os.makedirs(folder, exist_ok=True)
        k = PositionRecorder.forwards
        PositionRecorder.forwards += 1
        doc = {
            "task": "per_token",
            "pid": os.getpid(),
            "rank": self.rank,
            "forward": k,
            "timestamp": time.time(),
            "request_ids": self.request_ids,
            "tokens": self.tokens,
            "data": self.data,
        }
        path = os.path.join(folder, f"forward{k}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(doc, handle)
        os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- per-token records (RL_MSPROBE_RECORD_DIR)

# modules that only wrap another (FSDP1, activation checkpointing, Megatron's DDP / Float16Module):
# left out of the names, so a key reads `model.layers.0.mlp` as the rollout's does
_WRAPPERS = frozenset(
    (
        "FullyShardedDataParallel",
        "CheckpointWrapper",
        "OffloadWrapper",
        "DistributedDataParallel",
        "Float16Module",
    )
)
_WRAPPED = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module"))
_LAYER_NAME = re.compile(r"^(?:.*\.)?layers\.\d+$")


def records_enabled() -> bool:
    """RL_MSPROBE_RECORD_DIR set: the per-token records of docs/records.md (independent of DUMP_ON)."""
    return bool(os.environ.get("RL_MSPROBE_RECORD_DIR", "").strip())


def _records():
    from verl.utils import rl_msprobe_records

    return rl_msprobe_records


def records_wanted(engine, forward_only) -> bool:
    """Is this engine call the actor's log-prob forward? Forward-only, not the reference model's
    engine (`engine_config.forward_only`), not a value-head (critic) engine."""
    if not forward_only or not records_enabled():
        return False
    if getattr(getattr(engine, "engine_config", None), "forward_only", False):
        return False
    return "ValueHead" not in type(engine).__name__


def _prompts_copy(batch) -> bool:
    """The PROMPTS_ONLY copy (its responses emptied): its prompt rows are recorded by the step's own
    log-prob forward already."""
    responses = _responses(batch) if batch is not None else None
    return responses is not None and _empty(responses)


class _Named:
    """MODEL as the Recorder walks it (`named_modules`): wrapper modules left out of the names; a
    Megatron layer named by its global number (`layer_number - 1`), so that the pipeline stages'
    `decoder.layers.0` do not collide."""

    def __init__(self, model) -> None:
        self.model = model

    def named_modules(self):
        found: list = []
        self._walk(self.model, "", found, {id(self.model)})
        return found

    def _walk(self, module, prefix: str, found: list, seen: set) -> None:
        wrapper = type(module).__name__ in _WRAPPERS
        for child_name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if wrapper and child_name in _WRAPPED:
                name = prefix
            else:
                name = f"{prefix}.{child_name}" if prefix else child_name
            number = getattr(child, "layer_number", None)
            if isinstance(number, int) and _LAYER_NAME.match(name):
                name = name[: name.rindex(".") + 1] + str(number - 1)
            if name and type(child).__name__ not in _WRAPPERS:
                found.append((name, child))
            self._walk(child, name, found, seen)


def _non_tensor(batch, key: str, default):
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get_non_tensor_data(data=batch, key=key, default=default)
    except Exception:
        return default


def _runs(rid, row0: int, valid) -> list:
    """(request id, first row, first position, count) of each run of consecutive valid rows; the
    position of a row is its index among the request's valid rows."""
    runs: list = []
    position = 0
    for index, ok in enumerate(valid):
        if not ok:
            continue
        if runs and runs[-1][1] + runs[-1][3] == row0 + index:
            runs[-1][3] += 1
        else:
            runs.append([rid, row0 + index, position, 1])
        position += 1
    return runs


def _sp(engine) -> tuple:
    """(sp rank, sp size) of the engine's Ulysses sequence parallelism; (0, 1) without."""
    size = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if size <= 1:
        return 0, 1
    mesh = getattr(engine, "ulysses_device_mesh", None)
    if mesh is not None:
        return int(mesh["sp"].get_local_rank()), size
    from verl.utils.ulysses import get_ulysses_sequence_parallel_rank

    return int(get_ulysses_sequence_parallel_rank()), size


def fsdp_layout(engine, micro_batch, ids: list):
    """(Layout, header meta) of MICRO_BATCH's selected requests, rows as verl's FSDP engine
    (`FSDPEngineWithLMHead.prepare_model_inputs`) feeds the model. Each sample of the nested
    micro-batch holds the request's valid prompt tokens then its valid response tokens, so the
    position of its k-th token is k (prompt 0..P-1, response P..).

    - use_remove_padding (the default): the samples packed into one row stream [1, total_nnz]
      (`input_ids.values()`), sample i at rows offsets[i]..offsets[i+1]; `pad_to_length` appends pad
      rows at the end. Ulysses SP (size n > 1) pads the stream to a multiple of n and gives rank r
      its rows [r*len/n, (r+1)*len/n): this rank's layout holds the rows of its slice, with the
      positions they have in their request (pad rows belong to no request).
    - use_remove_padding=False: `to_padded_tensor` to [B, max_len], right-padded: sample i at
      rows i*max_len .. i*max_len+len_i-1.
    - a padded [B, L] micro-batch (no nested tensors): the valid rows by the attention mask (every
      row without one), positions counted among a sample's valid rows.
    """
    rec = _records()
    input_ids = micro_batch["input_ids"]
    rank, sp_rank, sp_size = _rank(engine), 0, 1
    segments: list = []
    if getattr(input_ids, "is_nested", False):
        lengths = [int(n) for n in input_ids.offsets().diff().tolist()]
        _check_count(ids, len(lengths))
        if _non_tensor(micro_batch, "use_remove_padding", True):
            nnz = sum(lengths)
            try:
                static = (
                    int(engine._get_packed_pad_size(nnz)) if getattr(engine, "pad_to_length", False) else 0
                )
            except AttributeError:
                static = 0
            total, first = nnz + static, 0
            sp_rank, sp_size = _sp(engine)
            if sp_size > 1:
                model = getattr(engine.module, "module", engine.module)
                if hasattr(getattr(model, "config", None), "vision_config"):
                    raise rec.RlMsprobeRecordError(
                        "RL_MSPROBE_RECORD_DIR: a vision-language actor with Ulysses sequence parallelism "
                        "(ulysses_sequence_parallel_size > 1) slices its inputs after the embedding, which the "
                        "training records do not follow; set actor.ulysses_sequence_parallel_size=1 for the "
                        "recorded steps, or unset RL_MSPROBE_RECORD_DIR."
                    )
                total = -(-total // sp_size)  # the padded stream's share per rank
                first = sp_rank * total
            start = 0
            for rid, n in zip(ids, lengths):
                lo, hi = max(start, first), min(start + n, first + total)
                if hi > lo and rec.selected(rid):
                    segments.append((rid, lo - first, lo - start, hi - lo))
                start += n
        else:
            width = max(lengths) if lengths else 0
            total = width * len(lengths)
            for i, (rid, n) in enumerate(zip(ids, lengths)):
                if rec.selected(rid):
                    segments.append((rid, i * width, 0, n))
    else:
        batch, width = int(input_ids.shape[0]), int(input_ids.shape[-1])
        _check_count(ids, batch)
        total = batch * width
        mask = micro_batch.get("attention_mask", None) if hasattr(micro_batch, "get") else None
        for i, rid in enumerate(ids):
            if rec.selected(rid):
                valid = [True] * width if mask is None else [bool(v) for v in mask[i].reshape(-1).tolist()]
                segments.extend(_runs(rid, i * width, valid))
    meta = {"rank": rank, "tp_rank": 0, "tp_size": 1, "phase": "train", "engine": "verl-fsdp"}
    if sp_size > 1:
        meta.update(sp_rank=sp_rank, sp_size=sp_size)
    return rec.Layout(total, segments), meta


def _check_count(ids: list, samples: int) -> None:
    if len(ids) != samples:
        raise _records().RlMsprobeRecordError(
            f"RL_MSPROBE_RECORD_DIR: the micro-batch holds {samples} samples but {len(ids)} request ids; "
            "the records need one request id per sample (the verl-request-id patch, applied with "
            "verl-consistency, carries them)."
        )


def record_start(engine, micro_batch, forward_only):
    """A Recorder over engine.module for this micro-batch's forward (the actor's log-prob forward,
    RL_MSPROBE_RECORD_DIR set, a selected request in it), else None. msprobe is never imported."""
    if not records_wanted(engine, forward_only) or _prompts_copy(micro_batch):
        return None
    ids = request_ids(micro_batch)
    if not ids:
        return None
    layout, meta = fsdp_layout(engine, micro_batch, ids)
    if layout.empty():
        return None
    return _records().Recorder(_Named(engine.module), layout, "train", meta)


# ---------------------------------------------------------------- Megatron engine


def megatron_batch_begin(engine, forward_only) -> None:
    """Decide once per batch (Megatron's schedule owns the micro-batch loop)."""
    if positions_enabled() and enabled():
        raise RlMsprobeConfigError(
            "DUMP_POSITIONS=1: per-token statistics are recorded on the FSDP engine only (not yet on "
            "Megatron); unset DUMP_POSITIONS (rl-msprobe prepare --prefill-only) to compare the prefill."
        )
    engine._rl_msprobe_records = records_wanted(engine, forward_only)
    if engine._rl_msprobe_records:
        _megatron_check(engine)
    engine._rl_msprobe_phase = (
        ("log_prob" if forward_only else "update_actor") if wants(engine, forward_only) else None
    )


def megatron_forward_start(engine, model, batch) -> None:
    engine._rl_msprobe_recorder = (
        _megatron_recorder(engine, model, batch) if getattr(engine, "_rl_msprobe_records", False) else None
    )
    phase = getattr(engine, "_rl_msprobe_phase", None)
    engine._rl_msprobe_started = phase is not None and wants_batch(batch)
    if engine._rl_msprobe_started:
        engine._rl_msprobe_step = _start(model)


def megatron_forward_end(engine, batch) -> None:
    recorder = getattr(engine, "_rl_msprobe_recorder", None)
    if recorder is not None:
        engine._rl_msprobe_recorder = None
        recorder.finish()
    phase = getattr(engine, "_rl_msprobe_phase", None)
    if phase is None or not getattr(engine, "_rl_msprobe_started", False):
        return
    _finish(engine, batch, getattr(engine, "_rl_msprobe_step", None), phase)


def _megatron_parallel() -> dict:
    """This rank's Megatron tensor / pipeline / context parallel ranks and sizes."""
    from megatron.core import parallel_state as mpu

    return {
        "tp_rank": int(mpu.get_tensor_model_parallel_rank()),
        "tp_size": int(mpu.get_tensor_model_parallel_world_size()),
        "pp_rank": int(mpu.get_pipeline_model_parallel_rank()),
        "pp_size": int(mpu.get_pipeline_model_parallel_world_size()),
        "cp_size": int(mpu.get_context_parallel_world_size()),
    }


def _megatron_check(engine) -> None:
    """Refuse, before the first micro-batch, the Megatron layouts the records do not follow."""
    rec = _records()
    config = getattr(engine, "engine_config", None)
    parallel = _megatron_parallel()
    tf_config = getattr(engine, "tf_config", None)
    why = None
    if parallel["cp_size"] > 1 or getattr(config, "dynamic_context_parallel", False):
        why = (
            "context parallelism (context_parallel_size > 1) splits each sequence across ranks in chunks",
            "actor.megatron.context_parallel_size=1",
        )
    elif parallel["tp_size"] > 1 and getattr(tf_config, "sequence_parallel", False):
        why = (
            "Megatron sequence parallelism (sequence_parallel with tensor parallelism) shards the token "
            "rows of the norms and residuals across the TP ranks",
            "actor.megatron.sequence_parallel=False",
        )
    elif not getattr(config, "use_remove_padding", True):
        why = (
            "the padded (bshd) layout (use_remove_padding=False)",
            "actor.megatron.use_remove_padding=True",
        )
    if why is not None:
        raise rec.RlMsprobeRecordError(
            f"RL_MSPROBE_RECORD_DIR on the Megatron engine: {why[0]}, which the training records do not "
            f"follow yet. Set {why[1]} for the recorded steps, or compare the prefill instead "
            "(rl-msprobe prepare --mode consistency --prefill-only: msprobe's dumps of the prompts), "
            "or use the FSDP engine."
        )


def _megatron_recorder(engine, model, batch):
    """A Recorder over the model chunk for this micro-batch's forward. Its layout is taken when the
    chunk is called, from the PackedSeqParams verl hands it (THD: sample i's valid rows start at
    cu_seqlens_q_padded[i], positions 0..len-1; the per-sample alignment to the TP size and any tail
    padding belong to no request): the same on every pipeline stage, each recording its own layers."""
    rec = _records()
    ids = request_ids(batch)
    if not ids or _prompts_copy(batch) or not any(rec.selected(rid) for rid in ids):
        return None
    meta = {"rank": _rank(engine), **_megatron_parallel(), "phase": "train", "engine": "verl-megatron"}
    meta.pop("cp_size")
    recorder = rec.Recorder(_Named(model), rec.Layout(0), "train", meta)

    input_ids = batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise rec.RlMsprobeRecordError(
            "RL_MSPROBE_RECORD_DIR on the Megatron engine: the micro-batch's input_ids are not nested "
            "(verl's no-padding layout), the only one the training records follow here."
        )
    lengths = [int(n) for n in input_ids.offsets().diff().tolist()]
    _check_count(ids, len(lengths))

    def layout(module, args, kwargs):
        padded = getattr(kwargs.get("packed_seq_params"), "cu_seqlens_q_padded", None)
        if padded is None:
            raise rec.RlMsprobeRecordError(
                "RL_MSPROBE_RECORD_DIR on the Megatron engine: the model chunk was called without "
                "packed_seq_params (THD), the only layout the training records follow here."
            )
        starts = [int(v) for v in padded.tolist()]
        segments = [
            (rid, starts[i], 0, n) for i, (rid, n) in enumerate(zip(ids, lengths)) if rec.selected(rid)
        ]
        recorder.layout = rec.Layout(starts[-1], segments)
        recorder._index = {}

    recorder.handles.append(model.register_forward_pre_hook(layout, with_kwargs=True))
    return recorder

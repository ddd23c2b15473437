"""Added to this tree by rl-msprobe: training-inference consistency helpers.

`rl-msprobe patch revert verl-consistency` removes this file and every line that calls it.
Two jobs, each called from one marked line (`# rl-msprobe:...`) in upstream verl code:

* ``trim_to_prompts(batch)`` -- with ``PROMPTS_ONLY=1`` the trainer recomputes the old
  log-probs of the prompts only, so the training engine runs exactly the prefill the rollout
  engine ran: the last ``responses.size(1)`` columns are cut from ``input_ids``,
  ``attention_mask`` and ``position_ids`` (last dim, so 2-D and 3-D mrope ids alike), and the
  response-aligned tensors (``responses``, ``response_mask``, ``rollout_log_probs``, ...) become
  empty. Without ``PROMPTS_ONLY=1`` it returns the batch untouched.
* the request-id chain -- the id the rollout server received is stored in the rollout
  output's ``extra_fields["request_id"]``; verl carries ``extra_fields`` into
  ``DataProto.non_tensor_batch`` and on into the engine's micro-batches, where the engine hook
  logs it (``rl_msprobe_hooks.request_ids(micro_batch)``). Active when ``DUMP_ON``, ``PROMPTS_ONLY`` or
  ``RL_MSPROBE_REQUEST_ID`` is ``1``; otherwise every function here is a no-op.

Depends only on the standard library, numpy and torch (imported lazily); never on rl-msprobe.
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

# Tensors with one column per response token: emptied by trim_to_prompts.
RESPONSE_KEYS = (
    "responses",
    "response_mask",
    "rollout_log_probs",
    "loss_mask",
    "rm_scores",
    "token_level_scores",
    "token_level_rewards",
)
# Tensors with one column per prompt+response token (last dim): cut to the prompt.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")
# Tensors with one row per prompt+response token in dim 1 (router replay): cut to the prompt.
SEQUENCE_DIM1_KEYS = ("routed_experts",)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() == "1"  # as the engine hooks read DUMP_ON


def prompts_only() -> bool:
    return _flag("PROMPTS_ONLY")


def request_ids_enabled() -> bool:
    return _flag("DUMP_ON") or _flag("PROMPTS_ONLY") or _flag("RL_MSPROBE_REQUEST_ID")


# ---------------------------------------------------------------------------- PROMPTS_ONLY


def trim_to_prompts(batch: Any) -> Any:
    """The batch with its responses cut away (``PROMPTS_ONLY=1``), else the batch unchanged.

    Accepts verl's ``DataProto`` (its ``.batch`` TensorDict is changed in place), a padded
    ``TensorDict`` or a plain dict of tensors, and the v1 trainer's TransferQueue
    ``KVBatchMeta`` (fields read, trimmed and written back). Applying it twice changes
    nothing more: once the responses are empty there is nothing left to cut.
    """
    if not prompts_only() or batch is None:
        return batch
    if _is_kv_batch_meta(batch):
        return _trim_kv_batch_meta(batch)
    tensors = getattr(batch, "batch", batch)  # DataProto -> its TensorDict
    if tensors is None:
        return batch
    trim_padded(tensors)  # meta_info is left alone: verl forwards it to every worker call
    return batch


def trim_padded(tensors: Any) -> Any:
    """Trim a padded batch (TensorDict or dict: ``[B, P + R]`` sequences, ``[B, R]`` responses) in place."""
    if "responses" not in _keys(tensors):
        return tensors
    response_len = int(tensors["responses"].shape[-1])
    if response_len == 0:
        return tensors
    for key in SEQUENCE_KEYS:
        if key in _keys(tensors):
            value = tensors[key]
            tensors[key] = value[..., : value.shape[-1] - response_len]
    for key in SEQUENCE_DIM1_KEYS:
        if key in _keys(tensors):
            value = tensors[key]
            if value.dim() >= 2:
                tensors[key] = value[:, : value.shape[1] - response_len]
    for key in RESPONSE_KEYS:
        if key in _keys(tensors):
            value = tensors[key]
            if value.dim() >= 2 and value.shape[-1] == response_len:
                tensors[key] = value[..., :0]
    return tensors


def trim_ragged(fields: Any) -> Any:
    """Trim an unpadded batch (one variable-length row per sample: jagged nested tensors or lists).

    ``prompts`` gives each sample's prompt length; sequences keep that many tokens (last
    dim), response-aligned fields become empty rows. Used for the v1 trainer's TransferQueue.
    """

    keys = _keys(fields)
    if "prompts" not in keys or "responses" not in keys:
        return fields
    prompt_lens = [int(p.shape[-1]) for p in _rows(fields["prompts"])]
    if all(int(r.shape[-1]) == 0 for r in _rows(fields["responses"])):
        return fields
    for key in SEQUENCE_KEYS:
        if key in keys:
            rows = [row[..., :n] for row, n in zip(_rows(fields[key]), prompt_lens)]
            fields[key] = _like(fields[key], rows)
    for key in SEQUENCE_DIM1_KEYS:  # one row per token: [P + R, ...] per sample
        if key in keys and fields[key] is not None:
            rows = [row[:n] for row, n in zip(_rows(fields[key]), prompt_lens)]
            fields[key] = _like(fields[key], rows)
    for key in RESPONSE_KEYS:
        if key in keys and fields[key] is not None:
            rows = [row[..., :0] for row in _rows(fields[key])]
            fields[key] = _like(fields[key], rows)
    return fields


def _rows(value: Any) -> list:
    if getattr(value, "is_nested", False):
        return list(value.unbind())
    return list(value)


def _like(original: Any, rows: list) -> Any:
    import torch

    if getattr(original, "is_nested", False):
        return torch.nested.as_nested_tensor(rows, layout=original.layout)
    if isinstance(original, torch.Tensor) and rows:
        if len({tuple(r.shape) for r in rows}) == 1:
            return torch.stack(rows)
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # as verl stores ragged rows
    return list(rows)


def _is_kv_batch_meta(batch: Any) -> bool:
    return type(batch).__name__ == "KVBatchMeta" or (
        hasattr(batch, "keys") and hasattr(batch, "partition_id") and not hasattr(batch, "batch")
    )


# Fields the v1 agent loop always writes to TransferQueue (AgentLoopWorkerTQ._agent_loop_postprocess),
# and those it writes only sometimes (asked for one by one: a missing field is skipped).
_KV_FIELDS = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask")
_KV_OPTIONAL = ("attention_mask", "rollout_log_probs", "rm_scores", "routed_experts")


def _trim_kv_batch_meta(batch: Any, tq: Any = None) -> Any:
    """Read the batch's fields from TransferQueue, trim them, write them back; same KVBatchMeta."""
    if tq is None:
        import transfer_queue as tq
    wanted = getattr(batch, "fields", None)

    def get(names):
        names = [n for n in names if wanted is None or n in wanted]
        return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=names)

    data = dict(get(_KV_FIELDS).items())
    for name in _KV_OPTIONAL:
        try:
            data.update(get([name]).items())
        except Exception:  # not stored for this batch
            continue
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=trim_ragged(data))
    return batch


def _keys(tensors: Any) -> set:
    try:
        return set(tensors.keys())
    except TypeError:  # a TensorDict's keys() view
        return set(iter(tensors.keys()))


# ---------------------------------------------------------------------------- request ids

# The first id sent to a rollout server within one agent-loop task (its prompt's prefill).
_FIRST_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rl_msprobe_request_id", default=None
)


class _RecordingMethod:
    """`server.generate` seen through the recorder: `.remote(...)` notes the request id."""

    def __init__(self, method: Any, owner: RequestIdRecorder) -> None:
        self._method = method
        self._owner = owner

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        request_id = kwargs.get("request_id", args[0] if args else None)
        if request_id is not None:
            self._owner.request_id = str(request_id)
        return self._method.remote(*args, **kwargs)

    def options(self, *args: Any, **kwargs: Any) -> _RecordingMethod:
        return _RecordingMethod(self._method.options(*args, **kwargs), self._owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)


class RequestIdRecorder:
    """A rollout-server handle that remembers the request id of its last `generate.remote` call."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.request_id: str | None = None

    @property
    def generate(self) -> _RecordingMethod:
        return _RecordingMethod(self._server.generate, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def record_request_id(server: Any) -> Any:
    """The server handle, wrapped so the id it receives is known (unchanged when disabled)."""
    if not request_ids_enabled() or isinstance(server, RequestIdRecorder):
        return server
    return RequestIdRecorder(server)


def keep_request_id(output: Any, server: Any) -> Any:
    """Store the id `server` received in `output.extra_fields["request_id"]` (when it has them).

    Rollout outputs without ``extra_fields`` (verl <= 0.7.0) keep the id for the agent loop,
    which attaches it to its own output (``attach_request_id``).
    """
    request_id = getattr(server, "request_id", None) if isinstance(server, RequestIdRecorder) else None
    if request_id is None:
        return output
    if _FIRST_REQUEST_ID.get() is None:
        _FIRST_REQUEST_ID.set(request_id)
    extra = getattr(output, "extra_fields", None)
    if isinstance(extra, dict):
        extra["request_id"] = request_id
    return output


def begin_request() -> None:
    """Forget ids seen earlier in this task: the next `generate` call starts a new sample."""
    _FIRST_REQUEST_ID.set(None)


def attach_request_id(output: Any) -> Any:
    """Give an agent-loop output the first id its sample sent to a server (if not set already)."""
    request_id = _FIRST_REQUEST_ID.get()
    extra = getattr(output, "extra_fields", None)
    if request_id is not None and isinstance(extra, dict):
        extra.setdefault("request_id", request_id)
    return output


def keep_parent_extra_fields(final_output: Any, output: Any) -> Any:
    """Fully-async client: carry each partial output's extra fields into the accumulated one.

    The first attempt wins (its request id is the prompt's prefill); fields the client sets
    itself afterwards (global steps, cached tokens) still overwrite these.
    """
    if not request_ids_enabled():
        return final_output
    source = getattr(output, "extra_fields", None)
    target = getattr(final_output, "extra_fields", None)
    if isinstance(source, dict) and isinstance(target, dict):
        for key, value in source.items():
            target.setdefault(key, value)
    return final_output


def lift_request_id(field: dict) -> dict:
    """v1 agent loop (TransferQueue): also store the id as a top-level ``request_id`` field of the
    sample, so the training engine's micro-batch carries it like the DataProto path does."""
    if not request_ids_enabled() or not isinstance(field, dict):
        return field
    extra = field.get("extra_fields")
    request_id = extra.get("request_id") if isinstance(extra, dict) else None
    field["request_id"] = "" if request_id is None else str(request_id)  # every sample has the key
    return field

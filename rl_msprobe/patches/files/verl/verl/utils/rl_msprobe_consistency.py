"""Added to this tree by rl-msprobe: training-inference consistency helpers.

`rl-msprobe patch revert verl-consistency` removes this file and every line that calls it.
Two jobs, each called from one marked line (`# rl-msprobe:...`) in upstream verl code:

* ``prompts_forward(trainer, batch)`` -- with ``PROMPTS_ONLY=1``, right before the trainer
  recomputes the old log-probs, the trainer's actor runs its log-prob forward once more on a
  *prompts-only copy* of the batch: the last ``responses.size(1)`` columns cut from
  ``input_ids``, ``attention_mask`` and ``position_ids`` (last dim, so 2-D and 3-D mrope ids
  alike), the response-aligned tensors (``responses``, ``response_mask``, ...) empty. That
  forward is exactly the prefill the rollout engine ran, and it is the one the engine hook dumps
  (``rl_msprobe_hooks`` dumps, under ``PROMPTS_ONLY=1``, only micro-batches without response
  tokens). The batch itself is returned untouched: the step then computes its old log-probs,
  advantages and update on the full responses and the job runs to its configured end.
  DataProto trainers: a deep copy, trimmed, through the trainer's own ``_compute_old_log_prob``
  (or ``actor_rollout_wg.compute_log_prob``); result discarded. TransferQueue trainers (v1,
  0.8.0's main_ppo_sync; the batch is a ``KVBatchMeta``): the fields are read, trimmed, put
  under new keys in a partition of their own (``PARTITION``), the copy's ``KVBatchMeta`` goes
  to ``actor_rollout_wg.compute_log_prob``, and the copy is cleared afterwards.
  Without ``PROMPTS_ONLY=1`` it does nothing.
* the request-id chain -- the id the rollout server received is stored in the rollout
  output's ``extra_fields["request_id"]``; verl carries ``extra_fields`` into
  ``DataProto.non_tensor_batch`` and on into the engine's micro-batches, where the engine hook
  logs it (``rl_msprobe_hooks.request_ids(micro_batch)``). Active when ``DUMP_ON``, ``PROMPTS_ONLY`` or
  ``RL_MSPROBE_REQUEST_ID`` is ``1``; otherwise every function here is a no-op. While active, the id
  the server receives is a *stable* one (``stable_request_id``) in place of verl's fresh uuid: the
  same prompt sent by the same agent-loop worker for the same time gets the same id in every run, so
  a report's request id names a request of the rerun (`--request`, `--zoom`) and the hash selection
  of records picks the same requests again.

Depends only on the standard library, numpy and torch (imported lazily), and on
``transfer_queue`` for a ``KVBatchMeta`` batch; never on rl-msprobe.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import socket
import threading
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


# ---------------------------------------------------------------------------- not covered


def not_covered(cls: Any, method: str, piece: str, reason: str, switches: tuple[str, ...]) -> None:
    """A marked line after CLS where rl-msprobe found no site for PIECE (``patch apply`` reported it
    not covered): CLS.METHOD then raises when it runs with one of SWITCHES set (``=1``), since
    this job would collect nothing from it. Off, it runs as upstream wrote it."""
    import functools
    import inspect

    metadata = getattr(cls, "__ray_metadata__", None)  # @ray.remote: patch the class Ray's actor derives from
    if metadata is not None:
        cls = metadata.modified_class.__ray_actor_class__
    original = getattr(cls, method)

    def refuse() -> None:
        on = [name for name in switches if _flag(name)]
        if on:
            raise RuntimeError(
                f"rl-msprobe: {cls.__name__}.{method} runs here, but rl-msprobe has no site in it ({piece}: "
                f"{reason}), so with {', '.join(f'{n}=1' for n in on)} this job would collect nothing from it. "
                "Update rl-msprobe and apply the patch again (`rl-msprobe patch status` lists what is not "
                f"covered), or run an entry point it covers; unset {', '.join(on)} to run without collecting."
            )

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            refuse()
            return await original(*args, **kwargs)
    else:

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            refuse()
            return original(*args, **kwargs)

    setattr(cls, method, guarded)


# ---------------------------------------------------------------------------- PROMPTS_ONLY


# The copy's TransferQueue partition and key suffix: apart from the trainer's own partitions
# ("train", "val"), so nothing that samples or lists those ever sees it.
PARTITION = "rl_msprobe_prompts_only"
KEY_SUFFIX = "@rl_msprobe_prompts_only"
_DONE = "_rl_msprobe_prompts_forward_done"  # one dump forward per batch object


def prompts_forward(trainer: Any, batch: Any) -> Any:
    """``PROMPTS_ONLY=1``: the actor's log-prob forward on a prompts-only copy of BATCH (the one the
    engine dumps); BATCH itself is returned unchanged. Without ``PROMPTS_ONLY=1``: nothing."""
    if not prompts_only() or batch is None or getattr(batch, _DONE, False):
        return batch
    if _is_kv_batch_meta(batch):
        _forward_kv_copy(trainer, batch)
    else:
        _forward_dataproto_copy(trainer, batch)
    try:  # fully-async: _fit_generate and the inherited _fit_compute_log_prob both call this
        setattr(batch, _DONE, True)
    except AttributeError:
        pass
    return batch


def trim_to_prompts(batch: Any) -> Any:
    """BATCH with its responses cut away, in place (``PROMPTS_ONLY=1``), else BATCH unchanged.

    Accepts verl's ``DataProto`` (its ``.batch`` TensorDict), a padded ``TensorDict`` or a plain
    dict of tensors. Applying it twice changes nothing more.
    """
    if not prompts_only() or batch is None:
        return batch
    tensors = getattr(batch, "batch", batch)  # DataProto -> its TensorDict
    if tensors is None:
        return batch
    trim_padded(tensors)  # meta_info is left alone: verl forwards it to every worker call
    return batch


def _forward_dataproto_copy(trainer: Any, batch: Any) -> None:
    import copy
    import inspect

    twin = trim_to_prompts(copy.deepcopy(batch))
    compute = getattr(trainer, "_compute_old_log_prob", None)
    if compute is not None and len(inspect.signature(compute).parameters) == 1:
        compute(twin)  # 0.8+ RayPPOTrainer: DataProto -> TensorDict -> engine -> padded again
    else:
        trainer.actor_rollout_wg.compute_log_prob(twin)


def _forward_kv_copy(trainer: Any, batch: Any, tq: Any = None) -> None:
    """TransferQueue: read BATCH's fields, trim them, run the forward on a copy, clear the copy."""
    if tq is None:
        import transfer_queue as tq
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=batch.fields)
    trim_ragged(data)
    keys = [f"{key}{KEY_SUFFIX}" for key in batch.keys]
    twin = tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=data)
    try:
        extra = dict(getattr(batch, "extra_info", None) or {})
        # what the trainer adds for its own old-log-prob call (the engine reads temperature)
        extra.update(calculate_entropy=True, compute_loss=False, temperature=_temperature(trainer))
        twin.extra_info = extra
        trainer.actor_rollout_wg.compute_log_prob(twin)
    finally:
        tq.kv_clear(keys=keys, partition_id=PARTITION)


def _temperature(trainer: Any) -> float:
    try:
        return float(trainer.config.actor_rollout_ref.rollout.temperature)
    except (AttributeError, TypeError, ValueError):
        return 1.0


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
    for key in RESPONSE_KEYS:  # one value per response token; a per-sample scalar stays
        if key in keys and fields[key] is not None:
            rows = _rows(fields[key])
            if rows and all(getattr(row, "dim", lambda: 0)() >= 1 for row in rows):
                fields[key] = _like(fields[key], [row[..., :0] for row in rows])
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


_SENT: dict[str, int] = {}  # prompt digest -> how many times this process has sent it
_SENT_LOCK = threading.Lock()
_ACTOR_SUFFIX = re.compile(
    r"_[0-9a-f]{8}$"
)  # verl names agent-loop workers f"agent_loop_worker_{i}_{uuid[:8]}"
_SENDER: list[str] = []


def _sender() -> str:
    """Who sends: the Ray actor's name without verl's random suffix (``agent_loop_worker_3``: the same
    worker gets the same chunk of the batch in every run), else this host and process (unique, but a
    rerun's ids then differ)."""
    if not _SENDER:
        name = None
        try:
            import ray

            name = ray.get_runtime_context().get_actor_name()
        except Exception:  # not in a Ray actor, or an older Ray
            name = None
        _SENDER.append(_ACTOR_SUFFIX.sub("", name) if name else f"{socket.gethostname()}:{os.getpid()}")
    return _SENDER[0]


def stable_request_id(prompt_ids: Any) -> str | None:
    """``rlm<16 hex>n<k>``: a digest of the sender and the prompt's token ids, and K, how many times
    this process sent that prompt before (GRPO's ``rollout.n`` copies: 0 .. n-1; a later turn's prompt
    holds the earlier turns, so it has its own digest). Unique among this process's requests, as the
    server needs, and the same in a rerun of the same steps. None when the prompt is not a sequence of
    token ids (the caller's id is kept)."""
    try:
        text = ",".join(str(int(token)) for token in prompt_ids)
    except (TypeError, ValueError):
        return None
    digest = hashlib.sha1(f"{_sender()}|{text}".encode()).hexdigest()[:16]
    with _SENT_LOCK:
        k = _SENT.get(digest, 0)
        _SENT[digest] = k + 1
    return f"rlm{digest}n{k}"


class _RecordingMethod:
    """`server.generate` seen through the recorder: `.remote(...)` sends a stable request id in place
    of the caller's (`stable_request_id`) and notes it."""

    def __init__(self, method: Any, owner: RequestIdRecorder) -> None:
        self._method = method
        self._owner = owner

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        request_id = kwargs.get("request_id", args[0] if args else None)
        if request_id is not None:
            stable = stable_request_id(kwargs.get("prompt_ids", args[1] if len(args) > 1 else None))
            if stable is not None:
                request_id = stable
                if "request_id" in kwargs:
                    kwargs["request_id"] = stable
                else:
                    args = (stable, *args[1:])
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

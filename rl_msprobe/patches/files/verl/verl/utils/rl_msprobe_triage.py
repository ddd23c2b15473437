"""Added to this tree by rl-msprobe: one JSON line per request with its rollout and training log-probs.

`rl-msprobe patch revert verl-triage` removes this file and every line that calls it.
One marked line (`# rl-msprobe:verl-triage-...`) follows each place where verl computes its own
rollout-vs-actor metrics (``metrics.update(calculate_debug_metrics(data))``, i.e.
``training/rollout_probs_diff_*``), and hands this module the very batch verl measured:
``rollout_log_probs`` (from ``actor_rollout_ref.rollout.calculate_log_probs=True``),
``old_log_probs`` (the training engine's recompute), ``responses`` and the mask verl uses
(``response_mask``, else the response part of ``attention_mask``).

With ``RL_MSPROBE_TRIAGE=<absolute folder>`` every request of every step becomes one line of
``<folder>/<pid>/triage.jsonl``; `rl-msprobe mismatch report <folder>` reads them. Unset, every
function here returns at once. No msprobe, no dumps, no constraint on the batch.

A line (schema ``rl-msprobe-triage/1``): ``step`` (the trainer's ``global_steps``), ``index``
(row in the step's batch), ``request_id`` (the id the rollout server received, kept by the
``verl-request-id`` set when ``RL_MSPROBE_REQUEST_ID=1``; else null), ``uid``, ``prompt_len``,
``rollout_dtype`` / ``train_dtype`` (only when not float32: verl's metric takes ``exp`` in the
tensor's own dtype, e.g. bf16 training log-probs), ``mask`` (only when some of the response
positions are masked out), ``sample`` (the dataset row's ``data_source``, ``prompt``,
``ability``, ``reward_model``, ``extra_info`` where the batch carries them: enough to write a
one-prompt data file that reproduces the request), and last, in this order (the report reads
them with numpy, not json): ``prompt_ids``, ``response_ids``, ``rollout_log_probs``,
``train_log_probs`` (one value per response position, up to the last position verl's mask
counts, 9 significant digits: a float32 round-trips; a non-finite value as null).

A failure here never stops training: it is written as one ``{"error": ...}`` line (the report
counts them) and printed once to stderr.

Depends only on the standard library and torch (imported lazily); never on rl-msprobe.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import traceback
from typing import Any

ENV = "RL_MSPROBE_TRIAGE"
SCHEMA = "rl-msprobe-triage/1"
SAMPLE_KEYS = ("data_source", "raw_prompt", "prompt", "ability", "reward_model", "extra_info")
_LOCK = threading.Lock()
_WARNED: list[bool] = []


def folder() -> str | None:
    value = os.environ.get(ENV, "").strip()
    return value or None


def log_requests(data: Any, trainer: Any = None, source: Any = None) -> None:
    """Write one line per request of `data` (verl's DataProto, or a dict/TensorDict of padded tensors).

    `trainer` gives the step (``global_steps``); `source` is the v1 trainer's TransferQueue
    ``KVBatchMeta`` whose other fields (prompts, ids, dataset row) are read from there.
    """
    where = folder()
    if where is None or data is None:
        return
    step = getattr(trainer, "global_steps", None)
    try:
        lines = list(_lines(data, step, source))
    except Exception as exc:  # triage must never stop a training job
        lines = [
            json.dumps({"schema": SCHEMA, "step": _plain(step), "error": f"{type(exc).__name__}: {exc}"})
        ]
        if not _WARNED:
            _WARNED.append(True)
            print(f"rl-msprobe triage: could not log step {step}:\n{traceback.format_exc()}", file=sys.stderr)
    _append(where, lines)


def _append(where: str, lines: list[str]) -> None:
    path = os.path.join(where, str(os.getpid()), "triage.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _LOCK, open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


# ---------------------------------------------------------------------------- reading the batch


def _lines(data: Any, step: Any, source: Any):
    tensors = getattr(data, "batch", data)
    rollout, train = tensors["rollout_log_probs"], tensors["old_log_probs"]
    responses = tensors["responses"]
    length = int(responses.shape[-1])
    keys = _keys(tensors)
    if "response_mask" in keys:  # verl's choice, in verl's order (calculate_debug_metrics)
        mask = tensors["response_mask"]
    elif "attention_mask" in keys:
        mask = tensors["attention_mask"][:, -length:]
    else:
        mask = None
    extra = dict(getattr(data, "non_tensor_batch", None) or {})
    extra.update(_from_transfer_queue(source))
    prompts = _prompt_rows(tensors, extra, length)
    rows = int(responses.shape[0])
    for i in range(rows):
        valid = [1] * length if mask is None else [int(v) for v in mask[i].tolist()]
        end = max((p + 1 for p, v in enumerate(valid) if v), default=0)
        line: dict[str, Any] = {
            "schema": SCHEMA,
            "step": _plain(step),
            "index": i,
            "request_id": _value(extra.get("request_id"), i),
            "uid": _value(extra.get("uid"), i),
        }
        prompt = prompts[i] if prompts is not None else None
        line["prompt_len"] = None if prompt is None else len(prompt)
        for key, tensor in (("rollout_dtype", rollout), ("train_dtype", train)):
            dtype = str(getattr(tensor, "dtype", "float32")).replace("torch.", "")
            if dtype != "float32":  # verl takes exp() in this dtype: the report does the same
                line[key] = dtype
        if 0 in valid[:end]:
            line["mask"] = valid[:end]
        sample = {k: _value(extra.get(k), i) for k in SAMPLE_KEYS if extra.get(k) is not None}
        if sample:
            line["sample"] = sample
        # the id and log-prob arrays last, in this order: the report reads them with numpy, not json
        line["prompt_ids"] = prompt
        line["response_ids"] = [int(t) for t in responses[i, :end].tolist()]
        line["rollout_log_probs"] = _Floats(rollout[i, :end].tolist())
        line["train_log_probs"] = _Floats(train[i, :end].tolist())
        yield _dumps(line)


def _prompt_rows(tensors: Any, extra: dict, response_len: int) -> list[list[int]] | None:
    """Each row's prompt token ids without padding (DataProto: left-padded; TransferQueue: ragged)."""
    prompts = extra.pop("prompts", None)
    if prompts is not None:  # ragged rows from TransferQueue
        return [[int(t) for t in _flat(row)] for row in _rows(prompts)]
    keys = _keys(tensors)
    if "prompts" not in keys:
        return None
    padded = tensors["prompts"]
    width = int(padded.shape[-1])
    if "attention_mask" in keys:
        attention = tensors["attention_mask"]
        prompt_mask = attention[:, :width] if attention.shape[-1] == width + response_len else None
    else:
        prompt_mask = None
    out = []
    for i in range(int(padded.shape[0])):
        ids = padded[i].tolist()
        if prompt_mask is not None:
            ids = [t for t, m in zip(ids, prompt_mask[i].tolist()) if m]
        out.append([int(t) for t in ids])
    return out


_TQ_FIELDS = ("prompts", "request_id", "uid", *SAMPLE_KEYS)


def _from_transfer_queue(source: Any) -> dict:
    """The v1 trainer's sample fields (prompts, ids, dataset row) for the rows of `source`."""
    if source is None or not hasattr(source, "partition_id") or not hasattr(source, "keys"):
        return {}
    import transfer_queue as tq

    out: dict[str, Any] = {}
    wanted = getattr(source, "fields", None)
    for name in _TQ_FIELDS:
        if wanted is not None and name not in wanted:
            continue
        try:
            got = tq.kv_batch_get(keys=source.keys, partition_id=source.partition_id, select_fields=[name])
            out[name] = got[name]
        except Exception:  # not stored for this batch
            continue
    if "request_id" not in out and "extra_fields" not in out:
        try:
            got = tq.kv_batch_get(
                keys=source.keys, partition_id=source.partition_id, select_fields=["extra_fields"]
            )
            fields = _rows(got["extra_fields"])
            out["request_id"] = [f.get("request_id") if isinstance(f, dict) else None for f in fields]
        except Exception:
            pass
    if "uid" not in out:
        out["uid"] = list(source.keys)
    return out


# ---------------------------------------------------------------------------- small helpers


class _Floats(list):
    """Floats written with 9 significant digits (a float32 round-trips), non-finite as null."""


def _dumps(line: dict) -> str:
    parts = []
    for key, value in line.items():
        if isinstance(value, _Floats):
            text = "[" + ",".join(f"{v:.9g}" if math.isfinite(v) else "null" for v in value) + "]"
        else:
            text = json.dumps(value, ensure_ascii=False, default=_plain)
        parts.append(f"{json.dumps(key)}: {text}")
    return "{" + ", ".join(parts) + "}"


def _keys(tensors: Any) -> set:
    try:
        return set(tensors.keys())
    except TypeError:
        return set(iter(tensors.keys()))


def _rows(value: Any) -> list:
    if getattr(value, "is_nested", False):
        return list(value.unbind())
    tolist = getattr(value, "tolist", None)
    if type(value).__name__ == "NonTensorStack" and callable(tolist):
        return list(tolist())
    return list(value)


def _flat(row: Any) -> list:
    tolist = getattr(row, "tolist", None)
    return list(tolist()) if callable(tolist) else list(row)


def _value(column: Any, i: int) -> Any:
    if column is None:
        return None
    try:
        return _plain(column[i])
    except (IndexError, KeyError, TypeError):
        return None


def _plain(value: Any) -> Any:
    """numpy / torch scalars and arrays, tensordict non-tensor data -> JSON-ready Python values."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    data = getattr(value, "data", None)
    if type(value).__name__ in ("NonTensorData", "NonTensorStack") and data is not None:
        return _plain(data)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _plain(tolist())
    return str(value)

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

A line (schema ``rl-msprobe-triage/2``; /1 had no ``distribution`` and no ``rollout_prompt_ids``): ``step`` (the trainer's ``global_steps``), ``index``
(row in the step's batch), ``request_id`` (the id the rollout server received, kept by the
``verl-request-id`` set when ``RL_MSPROBE_REQUEST_ID=1``; else null), ``uid``, ``prompt_len``,
``rollout_dtype`` / ``train_dtype`` (only when not float32: verl's metric takes ``exp`` in the
tensor's own dtype, e.g. bf16 training log-probs), ``mask`` (only when some of the response
positions are masked out), ``sample`` (the dataset row's ``data_source``, ``prompt``,
``ability``, ``reward_model``, ``extra_info`` where the batch carries them: enough to write a
one-prompt data file that reproduces the request), ``rollout_prompt_ids`` (only when the prompt
ids the rollout engine received differ from the ones the trainer scored), ``distribution`` (with
``RL_MSPROBE_TRIAGE_TOPK=k``: per response position the rollout's top-k ``rollout_ids`` and their
log-probs ``rollout`` (null: -inf, a token the engine masked out), the training engine's
log-probs of those ids ``train_at_rollout``, its own top-k ``train_ids`` / ``train``, its
logsumexp ``lse`` and verl's entropy ``entropy``, all after the temperature the trainer applies), and last, in this order (the report reads
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
SCHEMA = "rl-msprobe-triage/2"
TOPK_ENV = "RL_MSPROBE_TRIAGE_TOPK"
TOPK_KEY = "rl_msprobe_topk"  # extra_fields / non_tensor_batch: the rollout's top-k per position
PROMPT_KEY = "rl_msprobe_prompt_ids"  # extra_fields / non_tensor_batch: the prompt ids the engine got
IDS_KEY = "rl_msprobe_rollout_topk_ids"  # the workers' TensorDict: the rollout's top-k ids, padded
OUT_KEY = "rl_msprobe_topk"  # the engine's model_output: the training side per response position
_TRAIN: dict = {}  # the last old-log-prob call's training-side rows (the trainer process)
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
    train_rows = _TRAIN.pop("rows", None)
    entropy = next((tensors[key] for key in ("entropys", "entropy") if key in keys), None)
    if train_rows is not None and len(train_rows) != rows:
        train_rows = None  # not this batch's old-log-prob call
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
        seen = _value(extra.get(PROMPT_KEY), i)
        if seen is not None and prompt is not None and [int(t) for t in seen] != prompt:
            line["rollout_prompt_ids"] = [int(t) for t in seen]
        dist = _distribution(_value(extra.get(TOPK_KEY), i), train_rows, i, end, entropy)
        if dist is not None:
            line["distribution"] = dist
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
    if top_k():
        _top_k_from_transfer_queue(tq, source, out)
    return out


def _top_k_from_transfer_queue(tq: Any, source: Any, out: dict) -> None:
    """The rollout's top k and prompt ids (in each sample's extra_fields) and the training engine's
    rows (the field its model_output put), for the lines of a TransferQueue trainer."""
    try:
        got = tq.kv_batch_get(
            keys=source.keys, partition_id=source.partition_id, select_fields=["extra_fields"]
        )
        fields = [_plain(f) for f in _rows(got["extra_fields"])]
        out[TOPK_KEY] = [f.get(TOPK_KEY) if isinstance(f, dict) else None for f in fields]
        out[PROMPT_KEY] = [f.get(PROMPT_KEY) if isinstance(f, dict) else None for f in fields]
    except Exception as exc:
        _warn_once(f"rl-msprobe triage: no rollout top-k in TransferQueue: {type(exc).__name__}: {exc}")
    try:
        got = tq.kv_batch_get(keys=source.keys, partition_id=source.partition_id, select_fields=[OUT_KEY])
        _TRAIN["rows"] = [t.float().cpu() for t in _rows(got[OUT_KEY])]
    except Exception as exc:
        _warn_once(f"rl-msprobe triage: no training top-k in TransferQueue: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- the distribution (top k)


def top_k() -> int:
    """k of RL_MSPROBE_TRIAGE_TOPK (0: off; only with RL_MSPROBE_TRIAGE set where the trainer runs)."""
    try:
        return max(0, int(os.environ.get(TOPK_ENV, "0") or 0))
    except ValueError:
        return 0


def ask_top_k(sampling_params: dict) -> None:
    """The rollout server: ask the engine for its top k, where verl asks for the sampled token's log-prob."""
    k = top_k()
    if k and sampling_params.get("logprobs") is not None:
        sampling_params["logprobs"] = k


def keep_top_k(output: Any, prompt_ids: Any, extra_fields: dict) -> None:
    """The rollout server: the top-k ids and log-probs per position, and the prompt ids the engine
    received, into the output's extra_fields (verl's agent loop carries them into non_tensor_batch)."""
    k = top_k()
    if not k:
        return
    try:
        ids, lps = [], []
        for position in output.logprobs or []:
            ranked = sorted(
                ((getattr(lp, "rank", None) or 0, int(t), float(lp.logprob)) for t, lp in position.items()),
                key=lambda r: (r[0] if r[0] > 0 else 1 << 30, -r[2]),
            )[:k]
            ids.append([t for _, t, _ in ranked])
            lps.append([v for _, _, v in ranked])
        extra_fields[TOPK_KEY] = {"ids": ids, "lps": lps}
        extra_fields[PROMPT_KEY] = [int(t) for t in prompt_ids]
    except Exception as exc:  # triage must never stop a rollout
        _warn_once(f"rl-msprobe triage: could not keep the rollout's top-k: {type(exc).__name__}: {exc}")


def send_rollout_top_k(batch: Any, td: Any) -> None:
    """The trainer, before the old-log-prob call: the rollout's top-k ids, padded with -1 to
    [rows, response length, k], into the workers' TensorDict."""
    k = top_k()
    rows_topk = (getattr(batch, "non_tensor_batch", None) or {}).get(TOPK_KEY)
    if not k or folder() is None or rows_topk is None:
        return
    try:
        import torch

        width = int(batch.batch["responses"].shape[-1])
        ids = torch.full((len(rows_topk), width, k), -1, dtype=torch.int64)
        for i, row in enumerate(rows_topk):
            for p, top in enumerate((row or {}).get("ids", [])[:width]):
                ids[i, p, : len(top[:k])] = torch.tensor(top[:k], dtype=torch.int64)
        td[IDS_KEY] = ids
    except Exception as exc:
        _warn_once(f"rl-msprobe triage: could not send the rollout's top-k ids: {type(exc).__name__}: {exc}")


def train_top_k(
    logits: Any, micro_batch: Any, model_output: dict, log_probs: Any = None, labels: Any = None
) -> None:
    """The training engine, right after its log-probs of the sampled tokens (LOG_PROBS of LABELS)
    from its full-vocabulary logits (after the temperature): per response position the
    logsumexp (= logit - log-prob of the sampled token when those are float32: no second pass
    over the vocabulary; else one logsumexp over the response rows), the
    log-probs of the rollout's top-k ids and its own top k, as model_output[OUT_KEY] (one
    [positions, 1 + 3k] float32 tensor per sequence). The entropy is verl's own (its output)."""
    k = top_k()
    if not k:
        return
    import torch

    if getattr(logits, "requires_grad", False):  # the update's forward, not the old-log-prob recompute
        return
    try:
        keys = _keys(micro_batch)
        if IDS_KEY in keys:  # DataProto trainers: sent by send_rollout_top_k
            ids = micro_batch[IDS_KEY]
        elif "extra_fields" in keys:  # TransferQueue trainers: every field of the samples, extra_fields too
            ids = _ids_from_extra(micro_batch["extra_fields"], k)
        else:
            return
        if ids is None:
            return
        offsets = micro_batch["input_ids"].offsets().tolist()
        if int(logits.shape[0]) != offsets[-1]:  # a sequence-parallel shard: not covered
            _warn_once(
                "rl-msprobe triage: logits rows differ from the batch's tokens (sequence parallel?): no top-k"
            )
            return
        counts = (ids[:, :, 0] >= 0).sum(dim=1).tolist()
        rows, spans = [], []
        for i, n in enumerate(counts):
            length = offsets[i + 1] - offsets[i]
            start = offsets[i] + length - n - 1  # the logits at row r predict token r + 1
            rows.extend(range(start, start + n))
            spans.append(n)
        width = 1 + 3 * k
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        with torch.no_grad():
            # the response rows only, no log-softmax over the vocabulary: top k and gathers on the
            # logits, minus the logsumexp verl's log-prob gives (logit of the label - its log-prob)
            sel = logits.index_select(0, index).float()
            nnz = offsets[-1]
            exact = log_probs is not None and log_probs.dtype in (torch.float32, torch.float64)
            if exact and labels is not None and log_probs.numel() == nnz == labels.numel():
                # float32 log-probs only: bf16 ones (verl's CPU autocast) would put their rounding in lse
                lab = labels.reshape(-1).index_select(0, index).unsqueeze(1)
                lse = sel.gather(1, lab) - log_probs.reshape(-1).index_select(0, index).unsqueeze(1).float()
            else:
                lse = torch.logsumexp(sel, dim=-1, keepdim=True)
            mine, mine_ids = sel.topk(k, dim=-1)
            mine = mine - lse
            theirs = ids.to(logits.device)[
                torch.arange(len(counts), device=logits.device).repeat_interleave(
                    torch.tensor(counts, device=logits.device)
                ),
                torch.cat([torch.arange(n, device=logits.device) for n in counts]),
            ]
            at = sel.gather(1, theirs.clamp(min=0)) - lse
            at = torch.where(theirs >= 0, at, torch.full_like(at, float("nan")))
            packed = torch.cat([lse, at, mine_ids.float(), mine], dim=1).cpu()
        pieces, at_row = [], 0
        for n in spans:
            piece = packed[at_row : at_row + n] if n else torch.full((1, width), float("nan"))
            pieces.append(piece)
            at_row += n
        model_output[OUT_KEY] = torch.nested.as_nested_tensor(pieces, layout=torch.jagged)
    except Exception as exc:
        _warn_once(f"rl-msprobe triage: could not compute the training top-k: {type(exc).__name__}: {exc}")


def _ids_from_extra(extra: Any, k: int) -> Any:
    """The rollout's top-k ids of each sample's extra_fields (TransferQueue), padded with -1; None: none."""
    import torch

    rows = [_plain(row) for row in _rows(extra)]
    tops = [(row or {}).get(TOPK_KEY) if isinstance(row, dict) else None for row in rows]
    if not any(tops):
        return None
    width = max(len((top or {}).get("ids", [])) for top in tops)
    ids = torch.full((len(tops), max(width, 1), k), -1, dtype=torch.int64)
    for i, top in enumerate(tops):
        for p, row in enumerate((top or {}).get("ids", [])):
            ids[i, p, : len(row[:k])] = torch.tensor(row[:k], dtype=torch.int64)
    return ids


def keep_train_top_k(output: Any) -> None:
    """The trainer, after the old-log-prob call: the training side's rows for the next log_requests."""
    _TRAIN.pop("rows", None)
    try:
        if output is None or OUT_KEY not in _keys(output):
            return
        _TRAIN["rows"] = [t.float().cpu() for t in output[OUT_KEY].unbind()]
    except Exception as exc:
        _warn_once(f"rl-msprobe triage: could not read the training top-k: {type(exc).__name__}: {exc}")


def _distribution(rollout: Any, train_rows: Any, i: int, end: int, entropy: Any = None) -> dict | None:
    if not isinstance(rollout, dict) or train_rows is None:
        return None
    k = top_k() or len((rollout.get("ids") or [[]])[0])
    train = train_rows[i].tolist()
    n = min(end, len(rollout.get("ids", [])), len(train))
    rows = [r for r in train[:n]]
    out = {
        "k": k,
        "rollout_ids": [[int(t) for t in ids] for ids in rollout["ids"][:n]],
        "rollout": _Rows(rollout["lps"][:n]),
        "train_at_rollout": _Rows([r[1 : 1 + k] for r in rows]),
        "train_ids": [[int(t) for t in r[1 + k : 1 + 2 * k]] for r in rows],
        "train": _Rows([r[1 + 2 * k : 1 + 3 * k] for r in rows]),
        "lse": _Floats([r[0] for r in rows]),
    }
    if entropy is not None:  # verl's own entropy of the training distribution (old-log-prob call)
        out["entropy"] = _Floats(entropy[i, :n].tolist())
    return out


def _warn_once(text: str) -> None:
    if not _WARNED:
        _WARNED.append(True)
        print(text, file=sys.stderr)


# ---------------------------------------------------------------------------- small helpers


class _Rows(list):
    """Rows of floats, each written as _Floats."""


class _Floats(list):
    """Floats written with 9 significant digits (a float32 round-trips), non-finite as null."""


def _dumps(line: dict) -> str:
    return "{" + ", ".join(f"{json.dumps(key)}: {_text(value)}" for key, value in line.items()) + "}"


def _text(value: Any) -> str:
    if isinstance(value, _Floats):
        return "[" + ",".join(f"{v:.9g}" if math.isfinite(v) else "null" for v in value) + "]"
    if isinstance(value, _Rows):
        return "[" + ",".join(_text(_Floats(row)) for row in value) + "]"
    if isinstance(value, dict) and any(isinstance(v, (_Floats, _Rows)) for v in value.values()):
        return "{" + ", ".join(f"{json.dumps(k)}: {_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False, default=_plain)


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

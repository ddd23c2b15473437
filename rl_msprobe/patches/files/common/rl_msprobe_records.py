"""Per-token records of module inputs and outputs, for the selected requests of a batched forward.
Added to this tree by rl-msprobe (with the set that records here); `rl-msprobe patch revert`
removes it. One source for every tree that records (verl's trainer, vLLM, SGLang, vLLM-Ascend):
the format is rl-msprobe's `docs/records.md` ("rl-msprobe-records/1").

Why: msprobe's statistics describe a whole tensor of a whole batch; consistency compares a
request's row at a position. A caller (the engine helper) knows the batch layout — which rows of
this forward belong to which request, at which positions — and hands it to a `Recorder`, whose
forward hooks take each tensor's per-row Max, Min and L2 norm of the selected rows where the
tensor lives (a few reductions on the device, one copy to the host per forward).

Environment (docs/records.md): RL_MSPROBE_RECORD_DIR (the switch), RL_MSPROBE_RECORD_SHARE,
RL_MSPROBE_RECORD_IDS, RL_MSPROBE_RECORD_LAYERS, RL_MSPROBE_RECORD_MODULES.

Depends on the standard library and (lazily) torch; never on rl-msprobe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time

FORMAT = "rl-msprobe-records/1"
ENV_DIR = "RL_MSPROBE_RECORD_DIR"
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_counters: dict = {}
_schemas: dict = {}  # (folder, tensor table) -> its schema number in that folder


class RlMsprobeRecordError(RuntimeError):
    """A record switch is set but cannot be used: one clear message naming the variable."""


def record_dir() -> str | None:
    """The records' root when recording is on (RL_MSPROBE_RECORD_DIR), else None."""
    return os.environ.get(ENV_DIR, "").strip() or None


def base_id(request_id) -> str:
    """The id verl gave the request: vLLM's `-<8 hex>` suffix and SGLang PD's `_P` dropped
    (the same rule as rl-msprobe's `dumps.correlate.strip_request_id`)."""
    text = request_id.decode() if isinstance(request_id, bytes) else str(request_id)
    if len(text) >= 9 and text[-9] == "-":
        text = _VLLM_SUFFIX.sub("", text)
    return text[:-2] if text.endswith("_P") else text


def _share() -> float:
    raw = os.environ.get("RL_MSPROBE_RECORD_SHARE", "").strip()
    if not raw:
        return 1.0
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise RlMsprobeRecordError(
            f"RL_MSPROBE_RECORD_SHARE={raw!r} is not a share between 0 and 1; fix it or unset it (every request)."
        )
    return share


def _ids() -> set | None:
    raw = os.environ.get("RL_MSPROBE_RECORD_IDS", "").strip()
    return {base_id(part.strip()) for part in raw.split(",") if part.strip()} if raw else None


def selected(request_id) -> bool:
    """Is this request recorded? The same answer on every side for the same base id."""
    rid = base_id(request_id)
    wanted = _ids()
    if wanted is not None:
        return rid in wanted
    share = _share()
    if share >= 1.0:
        return True
    return int(hashlib.sha1(rid.encode()).hexdigest()[:8], 16) / 2**32 < share


def _layers() -> set | None:
    raw = os.environ.get("RL_MSPROBE_RECORD_LAYERS", "").strip()
    if not raw:
        return None
    try:
        return {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise RlMsprobeRecordError(
            f"RL_MSPROBE_RECORD_LAYERS={raw!r}: give layer numbers separated by commas (0,27), or unset it."
        ) from None


def _modules():
    raw = os.environ.get("RL_MSPROBE_RECORD_MODULES", "").strip()
    if not raw:
        return None
    try:
        return re.compile(raw)
    except re.error as exc:
        raise RlMsprobeRecordError(
            f"RL_MSPROBE_RECORD_MODULES={raw!r} is not a regular expression ({exc})."
        ) from None


def wanted_module(name: str, layers=None, pattern=None) -> bool:
    """Is module NAME recorded under the layer and name filters?"""
    if layers is not None:
        found = _LAYER.search(name)
        if found is not None and int(found.group(1)) not in layers:
            return False
    return pattern is None or pattern.search(name) is not None


def class_name(module) -> str:
    """MODULE's class as keys name it: FSDP2's `FSDP<Class>` (fully_shard's subclass) as `<Class>`."""
    cls = type(module)
    name = cls.__name__
    if name.startswith("FSDP") and any(base.__name__ == name[4:] for base in cls.__bases__):
        return name[4:]
    return name


class Layout:
    """Which rows of a forward belong to which selected request, at which positions.

    `total`: the token rows of the forward (a tensor is per token when its leading dimensions
    multiply to `total`); `segments`: (request id, first row, first position, count) of each
    selected request's rows; `samples`: (request id, row, position) of the rows of tensors with one
    row per sampled request (`num_samples` rows in all), e.g. vLLM's logits."""

    def __init__(self, total: int, segments=(), samples=(), num_samples: int | None = None) -> None:
        self.total = int(total)
        self.requests: list = []
        self.token_rows: list = []
        self.token_index: list = []
        for rid, row, position, count in segments:
            if count <= 0:
                continue
            self.token_rows.append([self._request(rid), int(position), int(count)])
            self.token_index.extend(range(int(row), int(row) + int(count)))
        self.sample_rows: list = []
        self.sample_index: list = []
        for rid, row, position in samples:
            self.sample_rows.append([self._request(rid), int(position)])
            self.sample_index.append(int(row))
        self.num_samples = num_samples

    def _request(self, rid) -> int:
        rid = base_id(rid)
        if rid not in self.requests:
            self.requests.append(rid)
        return self.requests.index(rid)

    def empty(self) -> bool:
        return not self.token_index and not self.sample_index


def batch_layout(req_ids, counts, firsts, total=None, starts=None, samples: bool = True) -> Layout:
    """The Layout of a forward whose token rows are its requests' in batch order (every engine's):
    request i has `counts[i]` contiguous rows (from row `starts[i]` when given, else right after
    request i-1's), the first at position `firsts[i]`. TOTAL: the rows the model sees (padding after
    the requests' rows), default their sum. SAMPLES: a tensor with one row per request (the logits
    of the last scheduled row), in batch order, also holds the selected requests' rows."""
    segments, sample_rows = [], []
    row = 0
    for index, (rid, count, first) in enumerate(zip(req_ids, counts, firsts)):
        row = int(starts[index]) if starts is not None else row
        count, first = int(count), int(first)
        if count > 0 and selected(rid):
            segments.append((rid, row, first, count))
            sample_rows.append((rid, index, first + count - 1))
        row += count
    return Layout(
        row if total is None else total,
        segments,
        sample_rows if samples else (),
        len(req_ids) if samples else None,
    )


def vllm_v1_layout(input_batch, scheduler_output):
    """(Layout, phase) of a V1 step: the persistent batch's requests (`input_batch.req_ids`) in row
    order, `num_scheduled_tokens[rid]` rows each, contiguous; positions from
    `num_computed_tokens_cpu[index]` (`_prepare_inputs`: computed + arange); the logits' rows one per
    request, in the same order, each at the request's last scheduled position
    (`logits_indices = query_start_loc[1:] - 1`). With speculative decoding the logits rows are per
    draft token and are not recorded as sample rows. vLLM-Ascend's NPUModelRunner (a GPUModelRunner) has the same batch."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    req_ids = [
        rid for rid in getattr(input_batch, "req_ids", None) or () if rid is not None and counts.get(rid)
    ]
    index = getattr(input_batch, "req_id_to_index", None) or {
        rid: i for i, rid in enumerate(input_batch.req_ids)
    }
    firsts = [int(input_batch.num_computed_tokens_cpu[index[rid]]) for rid in req_ids]
    prompts = getattr(input_batch, "num_prompt_tokens", None)
    prefill = sum(
        1 for rid, first in zip(req_ids, firsts) if prompts is not None and first < int(prompts[index[rid]])
    )
    spec = bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None))
    layout = batch_layout(req_ids, [int(counts[rid]) for rid in req_ids], firsts, samples=not spec)
    return layout, phase(prefill, len(req_ids) - prefill)


def watch_rows(recorder, model) -> None:
    """A forward pre-hook on MODEL (removed with the recorder's hooks) that sets the layout's total to
    the token rows the model really sees (its `input_ids`, else `positions`: vLLM pads a batch for
    data parallel or graph sizes after the requests' rows), so per-token tensors are told by their
    row count. Engines that call `model.forward(...)` directly never run it (then TOTAL stays)."""
    layout = recorder.layout

    def pre_hook(module, args, kwargs):
        for value in (kwargs.get("input_ids"), kwargs.get("positions"), *args[:2]):
            shape = getattr(value, "shape", None)
            if shape:
                layout.total = int(shape[-1])
                return None
        return None

    recorder.handles.append(model.register_forward_pre_hook(pre_hook, with_kwargs=True))


def phase(prefill: int, decode: int) -> str:
    """The header's phase of a forward computing prompt tokens for PREFILL requests and a decode
    token for DECODE requests."""
    return "mixed" if prefill and decode else ("prefill" if prefill else "decode")


class Recorder:
    """Forward hooks on MODEL's submodules for one forward; `finish()` writes the record.

    SIDE: "rollout" or "train"; META: header fields (rank, tp_rank, tp_size, phase, engine)."""

    def __init__(self, model, layout: Layout, side: str, meta: dict | None = None) -> None:
        import torch

        self.layout, self.side, self.meta = layout, side, dict(meta or {})
        self.tensors: list = []  # the tensor table: (key, label, dtype, width, rows) per tensor
        self.values: list = []
        self.calls: dict = {}
        self.handles: list = []
        self._index: dict = {}
        self._tensor = torch.Tensor
        self._no_grad = torch.no_grad
        self._grad_enabled = torch.is_grad_enabled
        layers, pattern = _layers(), _modules()
        for name, module in model.named_modules():
            if name and wanted_module(name, layers, pattern):
                self.handles.append(
                    module.register_forward_hook(self._hook(f"Module.{name}.{class_name(module)}.forward."))
                )

    def _hook(self, prefix: str):
        calls = self.calls

        def hook(module, args, output):
            n = calls.get(prefix, 0)
            calls[prefix] = n + 1
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if self._grad_enabled():  # the trainer's forward; an inference forward needs no guard
                with self._no_grad():
                    self._record_all(f"{prefix}{n}", args, outputs)
            else:
                self._record_all(f"{prefix}{n}", args, outputs)

        return hook

    def _rows(self, value, kind: str):
        """VALUE's selected rows as a 2-D tensor, or None when it is not per token / per sample."""
        if getattr(value, "is_nested", False) or value.dim() == 0:
            return None
        layout = self.layout
        count = layout.total if kind == "token" else layout.num_samples
        if not count:
            return None
        shape = value.shape
        lead, k = 1, 0
        while k < len(shape) and lead < count:
            lead *= int(shape[k])
            k += 1
        if lead != count:
            return None
        flat = value if len(shape) == 2 and k == 1 else value.reshape(count, -1)
        key = (kind, value.device)
        select = self._index.get(key)
        if select is None:
            select = self._index[key] = _selection(
                layout.token_index if kind == "token" else layout.sample_index, value.device
            )
        if select is False:
            return None
        if isinstance(select, tuple):  # one contiguous range of rows: a view, no copy
            start, n = select
            return flat if n == count else flat.narrow(0, start, n)
        return flat.index_select(0, select)

    def _record_all(self, key: str, args, outputs) -> None:
        tensor = self._tensor
        layout = self.layout
        samples = layout.num_samples and layout.num_samples != layout.total
        for role, values in (("input.", args), ("output.", outputs)):
            i = 0
            for value in values:
                if not isinstance(value, tensor):
                    continue
                label = f"{role}{i}"
                i += 1
                kind = "token"
                rows = self._rows(value, "token")
                if rows is None and samples:
                    kind, rows = "sample", self._rows(value, "sample")
                if rows is None or rows.shape[1] == 0:
                    continue
                self.values.append(_stats(rows))
                self.tensors.append((key, label, str(value.dtype), int(rows.shape[1]), kind))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def finish(self) -> str | None:
        """Remove the hooks and write the record (module doc); returns the header's path."""
        self.remove()
        root = record_dir()
        if root is None or not self.tensors:
            return None
        folder = os.path.join(root, self.side, str(os.getpid()))
        os.makedirs(folder, exist_ok=True)
        k = _counters.get(folder)
        if k is None:
            k = sum(1 for name in os.listdir(folder) if name.startswith("rec") and name.endswith(".json"))
        _counters[folder] = k + 1
        flat = _gather(self.values)
        base = os.path.join(folder, f"rec{k}")
        with open(base + ".f32", "wb") as handle:
            handle.write(flat.astype("<f4", copy=False).tobytes())
        header = {
            "format": FORMAT,
            "side": self.side,
            "pid": os.getpid(),
            "forward": k,
            "timestamp": time.time(),
            **self.meta,
            "requests": self.layout.requests,
            "token_rows": self.layout.token_rows,
            "sample_rows": self.layout.sample_rows,
            "schema": _schema(folder, self.tensors),
        }
        _write_json(base + ".json", header)
        self.values, self.tensors = [], []
        return base + ".json"


def _selection(index: list, device):
    """How a tensor's rows at INDEX are taken: (start, count) when they are one contiguous range
    (a view of the tensor: `narrow`), else an index tensor on DEVICE (`index_select`); False: none."""
    if not index:
        return False
    start = index[0]
    if index == list(range(start, start + len(index))):
        return (start, len(index))
    import torch

    return torch.tensor(index, dtype=torch.long, device=device)


def _stats(rows, fused: bool | None = None):
    """ROWS' per-row (Max, Min, L2 norm), computed where ROWS live (under the caller's no_grad):
    Max and Min on the native dtype (a floating tensor's are exact in it) and the norm accumulated
    in float32 (`vector_norm(dtype=float32)`: no float32 copy of a bf16 tensor). On an accelerator
    Max and Min are one fused `aminmax` reduction (FUSED: force it or not). On CPU what is fastest
    there, the same values: `amax` + `amin` (torch 2.13's CPU `aminmax` over a dimension is not
    vectorized: 8x1024 float32 19 us against 3.4 us, 132x1024 281 us against 14 us, one thread),
    and a bf16 / fp16 row block copied to float32 first (CPU half-precision reductions are slower
    than the copy: +8.1 against +6.8 ms a forward of the benchmark's Qwen2). Integer / bool
    tensors (token and position ids: one column) as float32. Max and Min stay in their dtype until
    `finish` converts them, grouped."""
    import torch

    if rows.dtype == torch.float32 and fused is None and rows.device.type == "cpu":  # the common CPU case
        return rows.amax(dim=1), rows.amin(dim=1), torch.linalg.vector_norm(rows, dim=1)
    cpu = rows.device.type == "cpu"
    if not rows.is_floating_point() or (cpu and rows.dtype in (torch.float16, torch.bfloat16)):
        rows = rows.float()
    if (not cpu) if fused is None else fused:
        lo, hi = torch.aminmax(rows, dim=1)
    else:
        hi, lo = rows.amax(dim=1), rows.amin(dim=1)
    if rows.dtype in (torch.float16, torch.bfloat16, torch.float32):
        norm = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
    else:  # float64 (and narrower exotic floats): the norm in its own dtype, converted in finish
        norm = torch.linalg.vector_norm(rows, dim=1)
    return hi, lo, norm


def _gather(values: list):
    """The record's float32 values (per tensor: its rows' Max, then Min, then norm) as a host numpy
    array, from VALUES (`_stats` of each tensor, in order): on the device, one concatenation per
    dtype, one conversion to float32 each, then one concatenation and ONE device->host copy; the
    per-tensor order is restored on the host."""
    import numpy
    import torch

    parts = [part for trio in values for part in trio]  # each one-dimensional: one value per row
    if all(part.dtype == torch.float32 for part in parts):  # a float32 model: already in order
        return torch.cat(parts).to("cpu").numpy() if parts else numpy.zeros(0, numpy.float32)
    groups: dict = {}
    for i, trio in enumerate(values):
        for j, part in enumerate(trio):
            groups.setdefault(part.dtype, []).append((i, j, part))
    pieces, where, offset = [], {}, 0
    for dtype, members in groups.items():
        joined = torch.cat([part for _, _, part in members])
        pieces.append(joined if dtype == torch.float32 else joined.float())
        for i, j, part in members:
            where[(i, j)] = (offset, offset + part.numel())
            offset += part.numel()
    host = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to("cpu").numpy()
    ordered = [host[slice(*where[(i, j)])] for i in range(len(values)) for j in range(3)]
    return numpy.concatenate(ordered) if ordered else numpy.zeros(0, numpy.float32)


def _write_json(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(doc, handle)
    os.replace(path + ".tmp", path)


TABLE_FIELDS = ("key", "label", "dtype", "width", "rows")


def _schema(folder: str, tensors: list) -> int:
    """The number of FOLDER's `schema{S}.json` holding this tensor table (TENSORS: one tuple of
    TABLE_FIELDS each), written the first time it is seen: a forward's header names its table
    instead of repeating it (at 80 layers, about a thousand tensors: ~160 KB a forward that a
    decode step's rows do not need)."""
    text = tuple(tensors)
    number = _schemas.get((folder, text))
    if number is None:
        number = sum(1 for where, _ in _schemas if where == folder)
        _write_json(
            os.path.join(folder, f"schema{number}.json"),
            {"format": FORMAT, "schema": number, "tensors": [dict(zip(TABLE_FIELDS, t)) for t in tensors]},
        )
        _schemas[(folder, text)] = number
    return number

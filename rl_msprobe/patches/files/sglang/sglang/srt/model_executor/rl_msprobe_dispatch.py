"""Which requests each dumped SGLang forward pass served. Added to this tree by rl-msprobe (patch set
sglang-dispatch-log).

`sglang/srt/model_executor/model_runner.py` calls `log_forward(self, forward_batch)` as the first
line of `ModelRunner.forward` (marked `# rl-msprobe:sglang-dispatch-log`); `rl-msprobe patch
revert sglang-dispatch-log --tree <this tree>` removes it and this file. Consistency mode pairs a
rollout prefill with the training micro-batch of the same request by request id (`rl-msprobe
dumps correlate`): this log is the rollout half of that join. verl passes its request id to
SGLang as `rid`; SGLang hands every forward pass the rids of its batch (`ForwardBatch.rids`).

It logs only while an msprobe debugger dumps in this ModelRunner: SGLang's own
(`self.msprobe_debugger`, from the server argument msprobe_dump_config, SGLang >= 0.5.11) or
rl-msprobe's sglang-dump patch's (below 0.5.11). Without one every call returns at once.

Output, per scheduler process (msprobe's dumps stay where msprobe writes them):
  {dump_path}/step{N}/rank{R}/dump.json ...   msprobe's files
  {dump_path}/{pid}/dispatch_log.jsonl        one line per dumped forward pass:
    {"source": "sglang", "timestamp", "pid", "rank", "step", "tp_rank", "tp_size", "phase":
     "prefill"|"decode"|<mode>, "forward_mode", "total_num_scheduled_tokens",
     "requests": [{"request_id", "type": "new"|"cached", "tokens"}]}
  `phase` is prefill for an extend pass (SGLang's prefill, also chunked and mixed), decode for a
  decode pass. A request is `new` when its extend starts at position 0 (the whole prompt, or the
  first chunk of a chunked one), `cached` when part of it is already in the KV cache (a radix
  cache hit, a later chunk, or a decode token); `tokens` is what this pass computes for it.

Per-token records (rl-msprobe's docs/records.md, `rl_msprobe_records.py` beside this file): with
RL_MSPROBE_RECORD_DIR set — with or without an msprobe dump — the same line starts a record of the
selected requests' rows of this forward pass (forward hooks on `runner.model`'s modules), laid out
from the ForwardBatch: `rids` in row order; an extend pass (prefill, a later chunk, a mixed batch)
`extend_seq_lens[i]` rows from position `extend_prefix_lens[i]`; a decode pass one row at
`seq_lens[i] - 1`. The hooks are removed when the model's `logits_processor` returns (SGLang calls
`model.forward` directly, so no hook on the model itself runs), also when it raises; a pass that
raised before it is discarded at the next pass. Not recorded: speculative passes (target_verify,
draft_extend), split prefill, idle passes (DP attention), CUDA-graph replays (SGLang captures decode
graphs unless disabled: run with --disable-cuda-graph, as the msprobe dump does), and the logits
themselves (LogitsProcessor returns a LogitsProcessorOutput, not a tensor: its input, the final
hidden states of every token row, is recorded). Unset, nothing is imported.

It depends on nothing but the standard library and SGLang's objects (duck-typed).
"""

from __future__ import annotations

import json
import os
import sys
import time

SOURCE = "sglang"
LOG_NAME = "dispatch_log.jsonl"
PATCH_DEBUGGER = "_rl_msprobe_debugger"  # set by the sglang-dump patch (SGLang < 0.5.11)


class RlMsprobeDispatchError(RuntimeError):
    """The dispatch log cannot name the requests of a forward pass in this SGLang."""


def _debugger(runner):
    return getattr(runner, "msprobe_debugger", None) or getattr(runner, PATCH_DEBUGGER, None)


def next_step(service) -> int:
    """The step the debugger's coming start() dumps as. msprobe moves `current_iter` to
    `loop + init_step` only inside start() (step() counts `loop`), so before start()
    `current_iter` still names the previous forward pass."""
    loop, init = getattr(service, "loop", None), getattr(service, "init_step", 0)
    if isinstance(loop, int) and isinstance(init, int):
        return loop + init
    return int(getattr(service, "current_iter", 0) or 0)


def _dumping(service, step: int, rank: int) -> bool:
    """Does msprobe dump this step on this rank (its config's `step` / `rank` lists)?"""
    if getattr(service, "should_stop_service", False):
        return False
    config = getattr(service, "config", None)
    steps = getattr(config, "step", None)
    ranks = getattr(config, "rank", None)
    return not (steps and step not in steps) and not (ranks and rank not in ranks)


def _rank(runner) -> int:
    """The rank msprobe names this runner's dump folder by: the debugger's own rule for data
    parallel replicas (rank_id=gpu_id), else the torch.distributed rank."""
    if getattr(runner, "msprobe_debugger", None) is not None:  # SGLang's own: gpu_id when self.dp_size > 1
        rank_id = runner.gpu_id if (getattr(runner, "dp_size", None) or 1) > 1 else None
    else:  # the sglang-dump patch's rule
        from sglang.srt.model_executor import rl_msprobe_dump

        rank_id = rl_msprobe_dump.rank_id(runner)
    if isinstance(rank_id, int):
        return rank_id
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def _ints(value) -> list[int] | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


def dispatch(forward_batch) -> tuple[str, str, list[dict], int]:
    """(phase, forward mode, requests, tokens) of one forward pass."""
    mode = getattr(forward_batch, "forward_mode", None)
    name = str(getattr(mode, "name", mode)).lower()
    rids = getattr(forward_batch, "rids", None)
    if rids is None:
        raise RlMsprobeDispatchError(
            "rl-msprobe sglang-dispatch-log: this SGLang's ForwardBatch carries no request ids (`rids`, SGLang "
            "0.5.10 and later), so dumped forward passes cannot be paired with their requests: revert the "
            "sglang-dispatch-log patch set (`rl-msprobe patch revert sglang-dispatch-log`) or upgrade SGLang."
        )
    extend = bool(mode is not None and getattr(mode, "is_extend", lambda: False)())
    decode = bool(mode is not None and getattr(mode, "is_decode", lambda: False)())
    requests = []
    if extend:
        lens = _ints(getattr(forward_batch, "extend_seq_lens_cpu", None)) or _ints(
            getattr(forward_batch, "extend_seq_lens", None)
        )
        prefixes = _ints(getattr(forward_batch, "extend_prefix_lens_cpu", None)) or _ints(
            getattr(forward_batch, "extend_prefix_lens", None)
        )
        for index, rid in enumerate(rids):
            prefix = prefixes[index] if prefixes and index < len(prefixes) else None
            tokens = lens[index] if lens and index < len(lens) else None
            requests.append(
                {"request_id": str(rid), "type": "new" if prefix == 0 else "cached", "tokens": tokens}
            )
    else:
        requests = [{"request_id": str(rid), "type": "cached", "tokens": 1} for rid in rids]
    total = sum(int(r["tokens"] or 0) for r in requests)
    phase = "prefill" if extend else "decode" if decode else name
    return phase, name, requests, total


# ---------------------------------------------------------------- per-token records

ENV_RECORD_DIR = "RL_MSPROBE_RECORD_DIR"  # rl_msprobe_records.ENV_DIR, read here without importing it
_RECORDS_ATTR = "_rl_msprobe_records"
RECORDED_MODES = (
    "extend",
    "mixed",
    "decode",
)  # not: target_verify / draft_extend (speculative), split_prefill, idle


def record_dir() -> str | None:
    return os.environ.get(ENV_RECORD_DIR, "").strip() or None


def layout(lib, forward_batch):
    """(Layout, phase) of one forward pass from its ForwardBatch, or (None, None) for a pass that is
    not recorded. Rows are the requests' in `rids` order, contiguous: an extend (prefill, chunked
    prefill, mixed) computes `extend_seq_lens[i]` tokens of request i from position
    `extend_prefix_lens[i]` (what the radix cache or earlier chunks hold); a decode one token at
    position `seq_lens[i] - 1`. Total rows: the forward's `input_ids` (padding included)."""
    mode = getattr(forward_batch, "forward_mode", None)
    name = str(getattr(mode, "name", mode)).lower()
    rids = getattr(forward_batch, "rids", None)
    if name not in RECORDED_MODES or not rids:
        return None, None
    if name == "decode":
        seq_lens = _ints(getattr(forward_batch, "seq_lens_cpu", None)) or _ints(forward_batch.seq_lens)
        counts, firsts = [1] * len(rids), [n - 1 for n in seq_lens]
        phase = "decode"
    else:
        counts = _ints(getattr(forward_batch, "extend_seq_lens_cpu", None)) or _ints(
            forward_batch.extend_seq_lens
        )
        firsts = _ints(getattr(forward_batch, "extend_prefix_lens_cpu", None)) or _ints(
            forward_batch.extend_prefix_lens
        )
        phase = "mixed" if name == "mixed" else "prefill"
    ids = getattr(forward_batch, "input_ids", None)
    total = int(ids.shape[0]) if getattr(ids, "shape", None) else None
    # no sample rows: SGLang's logits processor returns a LogitsProcessorOutput, not a tensor
    return lib.batch_layout(rids, counts, firsts, total=total, samples=False), phase


def _tp(runner) -> tuple[int | None, int | None]:
    """(TP rank, TP size): the runner's own (SGLang < 0.5.11 keeps them on ModelRunner), else SGLang's
    parallel state (0.5.23 moved them to `get_parallel()`)."""
    rank, size = getattr(runner, "tp_rank", None), getattr(runner, "tp_size", None)
    if isinstance(rank, int) and isinstance(size, int):
        return rank, size
    try:
        from sglang.srt.distributed import parallel_state

        return (
            int(parallel_state.get_tensor_model_parallel_rank()),
            int(parallel_state.get_tensor_model_parallel_world_size()),
        )
    except Exception:
        return None, None


class _Records:
    """The open record of one forward pass. SGLang calls `model.forward(...)` directly (no hook on the
    model itself runs), so the record is finished by a hook on the model's last module, its
    `logits_processor` (`always_call`: also when it raises), or else at the next forward pass."""

    def __init__(self, recorder, ends_with_logits: bool) -> None:
        self.recorder = recorder
        self.ends_with_logits = ends_with_logits
        self.done = False

    def finish(self, failed: bool = False) -> None:
        if self.done:
            return
        self.done = True
        if failed:
            self.recorder.remove()
        else:
            self.recorder.finish()


def start_records(runner, forward_batch) -> None:
    """Start the per-token record of this forward pass (RL_MSPROBE_RECORD_DIR set): forward hooks on
    `runner.model`'s modules for the selected requests' rows. A pass with no selected request hooks
    nothing."""
    stale = getattr(runner, _RECORDS_ATTR, None)
    if stale is not None:
        setattr(runner, _RECORDS_ATTR, None)
        # the previous pass never reached its logits: it raised (discard), or this rank has no logits
        # processor (a pipeline stage before the last: its record is whole)
        stale.finish(failed=stale.ends_with_logits)
    from sglang.srt.model_executor import rl_msprobe_records as lib

    built, phase = layout(lib, forward_batch)
    if built is None or built.empty():
        return
    try:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        rank = 0
    tp_rank, tp_size = _tp(runner)
    meta = {"rank": rank, "tp_rank": tp_rank, "tp_size": tp_size, "phase": phase, "engine": "sglang"}
    model = runner.model
    recorder = lib.Recorder(model, built, "rollout", meta)
    last = getattr(model, "logits_processor", None)
    records = _Records(recorder, last is not None)
    if last is not None:

        def end(module, args, output):
            setattr(runner, _RECORDS_ATTR, None)
            records.finish(failed=output is None)

        recorder.handles.append(last.register_forward_hook(end, always_call=True))
    setattr(runner, _RECORDS_ATTR, records)


def log_forward(runner, forward_batch) -> None:
    """First line of ModelRunner.forward: the per-token record of this pass (RL_MSPROBE_RECORD_DIR),
    and one dispatch log line when this pass is dumped by msprobe."""
    if record_dir() is not None:
        start_records(runner, forward_batch)
    debugger = _debugger(runner)
    if debugger is None:
        return
    service = getattr(debugger, "service", None)
    step = next_step(service)
    rank = _rank(runner)
    if not _dumping(service, step, rank):
        return
    try:
        phase, name, requests, total = dispatch(forward_batch)
        dump_path = getattr(getattr(service, "config", None), "dump_path", None)
        if not dump_path:
            raise RuntimeError("the msprobe config has no dump_path")
        pid = os.getpid()
        folder = os.path.join(dump_path, str(pid))
        os.makedirs(folder, exist_ok=True)
        line = {
            "source": SOURCE,
            "timestamp": time.time(),
            "pid": pid,
            "rank": rank,
            "step": step,
            "tp_rank": getattr(runner, "tp_rank", None),
            "tp_size": getattr(runner, "tp_size", None),
            "phase": phase,
            "forward_mode": name,
            "total_num_scheduled_tokens": total,
            "requests": requests,
        }
        with open(os.path.join(folder, LOG_NAME), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
    except RlMsprobeDispatchError:
        raise
    except Exception as exc:  # the rollout goes on; the missing line shows as an unpaired request
        print(f"rl-msprobe: dispatch log not written for step {step}: {exc}", file=sys.stderr)

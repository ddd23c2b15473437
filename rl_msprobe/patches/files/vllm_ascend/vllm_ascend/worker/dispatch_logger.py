"""Dispatch log for msprobe rollout dumps. Added to this tree by rl-msprobe (patch set vllm-ascend-dispatch-log).

`vllm_ascend/worker/model_runner_v1.py` calls this module from a few marked lines
(`# rl-msprobe:vllm-ascend-model-runner`); `rl-msprobe patch revert vllm-ascend-dispatch-log
--tree <this tree>` removes them and this file. Nothing here runs unless vLLM-Ascend's own
msprobe dump is on (`additional_config.dump_config_path`): the runner then has a debugger,
and this module

  - moves the debugger's dump path to a `{pid}` sub-folder (`attach`, right after the
    debugger is created), so the engine processes of one job never write into each other;
  - writes one JSON line per dumped model step (`log_step`, just before each point where a
    step's dump is finished: `self.debugger.stop()` in 0.12-0.19, `self._finalize_dump_data()`
    from 0.20), only while the debugger is still dumping that step.

Output:
  {dump_path}/{pid}/step{N}/rank{R}/dump.json ...   msprobe's files
  {dump_path}/{pid}/dispatch_log.jsonl               one line per dumped step:
    {"source": "vllm-ascend", "timestamp", "pid", "rank", "step", "phase": "prefill"|"decode",
     "total_num_scheduled_tokens", "requests": [{"request_id", "type": "new"|"cached", "tokens"}]}

`step` is the debugger's step (msprobe's `current_iter`, or `step_id` of an `AclGraphDumper`),
so line N names the `step{N}` folder it describes. `phase` is prefill when the step computes
prompt tokens for any request (a new request, a chunked-prefill continuation, a request
resumed after preemption); when the prompt lengths cannot be read it falls back to the
runner's attention state (decode for DecodeOnly / SpecDecoding) and then to "new requests
scheduled". Speculative-decoding steps are therefore decode, not prefill. Request ids are
vLLM's (vLLM >= 0.14 appends `-<8 hex>` to the caller's id).

The module is engine-neutral: `attach(runner, source=...)` and `log_step(runner,
scheduler_output)` work on any runner with a `debugger` attribute, and `DispatchLogger`,
`scheduled_requests`, `phase_of`, `debugger_step`, `is_dumping` on duck-typed vLLM objects
(new / cached requests of every vLLM V1 scheduler generation). It depends on nothing but the
standard library and, lazily, torch.

Per-token records (rl-msprobe's docs/records.md; `rl_msprobe_records.py` beside this file), with
or without the dump: with RL_MSPROBE_RECORD_DIR set, `start_records(self, scheduler_output)` (a
marked line just before the model forward of `execute_model`) hooks `runner.model`'s modules for the
selected requests' rows, laid out from the persistent batch as vLLM's V1 runner has it
(NPUModelRunner is a GPUModelRunner: `input_batch.req_ids` in row order,
`num_scheduled_tokens[rid]` rows each, first position `num_computed_tokens_cpu[index]`; the logits,
computed in `execute_model`, one row per request). `@record_step` on `execute_model` writes the
record on every way out (a step that raises writes nothing) and removes the hooks. Not recorded:
the logits under `lmhead_tp_enable()` (its logits rows are padded to the DP batch) and with
speculative decoding (rows per draft token); ACL-graph (non-eager) steps, whose modules do not run
their hooks. Proven by shape on the release trees only (no NPU here): tests/patches/files/
test_vllm_ascend_dispatch_logger.py runs this path on a stand-in runner and a real torch model.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

SOURCE = "vllm-ascend"
LOG_NAME = "dispatch_log.jsonl"
ATTR = "_rl_msprobe_dispatch_logger"
ENV_RECORD_DIR = "RL_MSPROBE_RECORD_DIR"  # rl_msprobe_records.ENV_DIR, read here without importing it
RECORDS_ATTR = "_rl_msprobe_records"
DECODE_STATES = ("DecodeOnly", "SpecDecoding")


# ---------------------------------------------------------------- the scheduler output


def _prompt_len(obj) -> int | None:
    count = getattr(obj, "num_prompt_tokens", None)
    if isinstance(count, int):
        return count
    ids = getattr(obj, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    embeds = getattr(obj, "prompt_embeds", None)
    shape = getattr(embeds, "shape", None)
    return int(shape[0]) if shape else None


def _cached(scheduler_output) -> list[tuple[str, int | None]]:
    """(request id, tokens computed before this step) of each cached request, in order.

    vLLM >= 0.9.2: one `CachedRequestData` with parallel lists (`req_ids`, `num_computed_tokens`);
    before: a list of per-request `CachedRequestData` objects (`req_id`, `num_computed_tokens`).
    """
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return []
    ids = getattr(cached, "req_ids", None)
    if ids is not None:
        computed = list(getattr(cached, "num_computed_tokens", None) or ())
        return [(str(rid), computed[i] if i < len(computed) else None) for i, rid in enumerate(ids)]
    return [(str(item.req_id), getattr(item, "num_computed_tokens", None)) for item in cached]


def scheduled_requests(scheduler_output) -> list[dict]:
    """`[{request_id, type: new|cached, tokens}]`: new requests first, then cached ones, in order."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    out = [
        {"request_id": str(new.req_id), "type": "new", "tokens": int(counts.get(new.req_id, 0))}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ()
    ]
    out += [
        {"request_id": rid, "type": "cached", "tokens": int(counts.get(rid, 0))}
        for rid, _ in _cached(scheduler_output)
    ]
    return out


def phase_of(scheduler_output, requests=None, attn_state=None) -> str:
    """prefill | decode for one step (see the module doc). `requests`: the runner's request
    states (`runner.requests`) for cached requests' prompt lengths; `attn_state`: the runner's
    attention state (vLLM-Ascend's `AscendAttentionState`), the fallback."""
    requests = requests if hasattr(requests, "get") else {}
    known = True
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        prompt = _prompt_len(new)
        computed = getattr(new, "num_computed_tokens", 0) or 0
        if prompt is None:
            known = False
        elif computed < prompt:
            return "prefill"
    for rid, computed in _cached(scheduler_output):
        state = requests.get(rid)
        prompt = _prompt_len(state) if state is not None else None
        if computed is None and state is not None:
            computed = getattr(state, "num_computed_tokens", None)
        if prompt is None or computed is None:
            known = False
        elif computed < prompt:
            return "prefill"
    if known:
        return "decode"
    if attn_state is not None:
        name = getattr(attn_state, "name", str(attn_state).rsplit(".", 1)[-1])
        return "decode" if name in DECODE_STATES else "prefill"
    return "prefill" if getattr(scheduler_output, "scheduled_new_reqs", None) else "decode"


# ---------------------------------------------------------------- the msprobe debugger


def _service(debugger):
    return getattr(debugger, "service", None)  # PrecisionDebugger has one; AclGraphDumper does not


def debugger_step(debugger) -> int:
    """The step the debugger is dumping now (the N of `step{N}`)."""
    service = _service(debugger)
    value = (
        getattr(service, "current_iter", None) if service is not None else getattr(debugger, "step_id", None)
    )
    return int(value) if isinstance(value, int) else 0


def debugger_rank(debugger) -> int:
    service = _service(debugger)
    rank = (
        getattr(service, "current_rank", None) if service is not None else getattr(debugger, "rank_id", None)
    )
    if isinstance(rank, int):
        return rank
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def is_dumping(debugger) -> bool:
    """Does the debugger write a dump for the step it is in now?"""
    service = _service(debugger)
    if service is None:  # AclGraphDumper: started on a dumped rank, dump switch on
        return bool(getattr(debugger, "_running", True)) and bool(getattr(debugger, "dump_enable", True))
    if getattr(service, "should_stop_service", False):
        return False
    config = getattr(service, "config", None)
    if getattr(config, "dump_enable", None) is False:  # msprobe's run-time switch in the config file
        return False
    steps = getattr(config, "step", None)
    if steps and getattr(service, "current_iter", None) not in steps:
        return False
    ranks = getattr(config, "rank", None)
    current_rank = getattr(service, "current_rank", None)
    return not (ranks and current_rank is not None and current_rank not in ranks)


def dump_path(debugger) -> str | None:
    service = _service(debugger)
    holder = getattr(service, "config", None) if service is not None else debugger
    value = getattr(holder, "dump_path", None)
    return value if isinstance(value, str) and value else None


def set_dump_path(debugger, path: str) -> None:
    """msprobe reads `service.config.dump_path` at each start (setting `debugger.config.dump_path`
    has no effect); an AclGraphDumper keeps its own `dump_path`."""
    service = _service(debugger)
    holder = getattr(service, "config", None) if service is not None else debugger
    holder.dump_path = path


# ---------------------------------------------------------------- the log


class DispatchLogger:
    """Appends one JSON line per dumped step to `{folder}/dispatch_log.jsonl`."""

    def __init__(self, folder: str, source: str = SOURCE, pid: int | None = None) -> None:
        self.folder = folder
        self.source = source
        self.pid = os.getpid() if pid is None else pid
        self.path = os.path.join(folder, LOG_NAME)

    def record(self, scheduler_output, step: int, rank: int, phase: str) -> dict:
        return {
            "source": self.source,
            "timestamp": time.time(),
            "pid": self.pid,
            "rank": rank,
            "step": step,
            "phase": phase,
            "total_num_scheduled_tokens": int(
                getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0
            ),
            "requests": scheduled_requests(scheduler_output),
        }

    def write(self, line: dict) -> dict:
        os.makedirs(self.folder, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        return line


# ---------------------------------------------------------------- called from the marked lines


def attach(runner, source: str = SOURCE) -> DispatchLogger | None:
    """After the runner's debugger is created: move its dump path to `{dump_path}/{pid}` and
    keep a logger writing there."""
    debugger = getattr(runner, "debugger", None)
    base = dump_path(debugger) if debugger is not None else None
    if base is None:
        return None
    pid = os.getpid()
    folder = base if os.path.basename(os.path.normpath(base)) == str(pid) else os.path.join(base, str(pid))
    set_dump_path(debugger, folder)
    logger = DispatchLogger(folder, source=source, pid=pid)
    setattr(runner, ATTR, logger)
    return logger


def log_step(runner, scheduler_output) -> dict | None:
    """Just before a step's dump is finished: one line, when this step is being dumped."""
    logger = getattr(runner, ATTR, None)
    debugger = getattr(runner, "debugger", None)
    if logger is None or debugger is None or scheduler_output is None:
        return None
    if getattr(runner, "_debugger_started", True) is False:  # 0.20+: nothing was started this step
        return None
    if not is_dumping(debugger):
        return None
    try:
        phase = phase_of(
            scheduler_output, getattr(runner, "requests", None), getattr(runner, "attn_state", None)
        )
        return logger.write(
            logger.record(scheduler_output, debugger_step(debugger), debugger_rank(debugger), phase)
        )
    except Exception as exc:  # the rollout goes on; the missing line is reported
        print(f"rl-msprobe: {logger.path}: dispatch log line not written ({exc!r})", file=sys.stderr)
        return None


# ---------------------------------------------------------------- per-token records


def record_dir() -> str | None:
    """The per-token records' root (RL_MSPROBE_RECORD_DIR), else None: then nothing is imported."""
    return os.environ.get(ENV_RECORD_DIR, "").strip() or None


def _tp() -> tuple[int | None, int | None]:
    try:
        from vllm.distributed import parallel_state

        group = parallel_state.get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:
        return None, None


def start_records(runner, scheduler_output) -> None:
    """Just before the model forward in execute_model: the step's record of its selected requests
    (no selected request: no hook)."""
    if record_dir() is None or getattr(runner, RECORDS_ATTR, None) is not None or scheduler_output is None:
        return
    from vllm_ascend.worker import rl_msprobe_records as lib

    layout, phase = lib.vllm_v1_layout(runner.input_batch, scheduler_output)
    if layout.empty():
        return
    tp_rank, tp_size = _tp()
    meta = {"rank": debugger_rank(None), "tp_rank": tp_rank, "tp_size": tp_size, "phase": phase,
            "engine": "vllm-ascend"}  # fmt: skip
    recorder = lib.Recorder(runner.model, layout, "rollout", meta)
    lib.watch_rows(recorder, runner.model)
    setattr(runner, RECORDS_ATTR, recorder)


def record_step(execute_model):
    """Decorator for NPUModelRunner.execute_model: the step's record written, and its hooks removed,
    on every way out (a step that raises writes nothing)."""

    @functools.wraps(execute_model)
    def execute_model_with_records(self, *args, **kwargs):
        if record_dir() is None:
            return execute_model(self, *args, **kwargs)
        try:
            result = execute_model(self, *args, **kwargs)
        except BaseException:
            recorder = self.__dict__.pop(RECORDS_ATTR, None)
            if recorder is not None:
                recorder.remove()
            raise
        recorder = self.__dict__.pop(RECORDS_ATTR, None)
        if recorder is not None:
            recorder.finish()
        return result

    return execute_model_with_records

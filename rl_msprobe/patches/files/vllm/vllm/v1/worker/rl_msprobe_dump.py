"""msprobe rollout dump for vLLM's model runners. Added to this tree by rl-msprobe (patch set vllm-dump).

The V1 runner (`vllm/v1/worker/gpu_model_runner.py`, `# rl-msprobe:vllm-model-runner`) and the V2
runner (`vllm/v1/worker/gpu/model_runner.py`, `# rl-msprobe:vllm-v2-model-runner`), whichever the
tree has, call this module from a few marked lines; `rl-msprobe patch revert vllm-dump --tree <this
tree>` removes them and this file. The CPU runners inherit the patched
`GPUModelRunner.execute_model` of their runner, so they dump the same way.

Environment:
  MSPROBE_ROLLOUT_CONFIG=PATH  the msprobe config.json for the rollout (it must set dump_path).
                               Unset or empty: every function here returns at once, msprobe is
                               never imported and nothing is written.
  MSPROBE_ROLLOUT_PHASES=prefill  dump the prefill steps only (decode steps run undumped and do not
                               advance msprobe's step); unset: every model step.
  The config's `request_id` (msprobe 26.2's per-request slice; a base id, without vLLM's `-<8 hex>`):
                               the V1 runner passes `scheduled_tokens` in its row order, so msprobe keeps
                               only that request's rows and skips steps without it (`request_slice`).
  Whichever runner vLLM chooses (VLLM_USE_V2_MODEL_RUNNER, or vLLM's own choice) dumps.
Eager execution is required (`enforce_eager=True`; verl: actor_rollout_ref.rollout.enforce_eager=True):
the runner refuses to start otherwise.

How a model step is dumped (one msprobe step per `execute_model` call that runs the model):
  - `dump_step` wraps `GPUModelRunner.execute_model` (a decorator line): it notes which requests
    the step serves and, in a `finally`, stops and steps the debugger on every way out of
    `execute_model` — each `return` and any exception.
  - `start_forward` (a line just before the model forward) starts the debugger on
    `runner.model`, so the dump covers the forward (V1: and the logits; the V2 runner computes them
    in `sample_tokens`), not the input preparation; sampling (`sample_tokens`) is not dumped. Calls
    that run no forward (nothing scheduled, the V2 runner's `dummy_run=True` warm-up and DP
    padding runs) dump nothing and do not advance msprobe's step.

Output, per process (`{pid}` keeps the engine processes of one job apart):
  {dump_path}/{pid}/step{N}/rank{R}/dump.json ...   msprobe's files
  {dump_path}/{pid}/dispatch_log.jsonl               one line per dumped step:
    {"source": "vllm", "timestamp", "pid", "rank", "step", "tp_rank", "tp_size",
     "phase": "prefill"|"decode",
     "total_num_scheduled_tokens", "requests": [{"request_id", "type": "new"|"cached", "tokens"}]}
  `phase` is prefill when the step computes prompt tokens for any request (a new request, a
  chunked-prefill continuation, a request resumed after preemption); request ids are vLLM's
  (vLLM >= 0.14 appends `-<8 hex>` to the caller's id).

Per-token records (rl-msprobe's docs/records.md; `rl_msprobe_records.py` beside this file):
  RL_MSPROBE_RECORD_DIR=/abs/dir   the switch, independent of MSPROBE_ROLLOUT_CONFIG (either, both or
                               neither); unset, nothing of it is imported. RL_MSPROBE_RECORD_SHARE /
                               _IDS / _LAYERS / _MODULES choose the requests and modules.
  - `start_forward` lays out the step from the runner's own batch, after it prepared its inputs:
    V1 `runner.input_batch.req_ids` in row order, `scheduler_output.num_scheduled_tokens[rid]`
    rows each, contiguous, first position `num_computed_tokens_cpu[i]`; V2 the step's `InputBatch`
    (passed by the marked line: `req_ids` as the runner sorted them, `query_start_loc_np`,
    `num_scheduled_tokens`, `num_computed_tokens_np`). A step with no selected request hooks nothing.
  - Forward hooks on `runner.model`'s modules take each input / output row's Max, Min and norm of the
    selected rows; the logits (`logits_processor`: V1 in execute_model, V2 in sample_tokens) one
    `sample` row per request at its last scheduled position. The record is written when the step's
    logits processor returns, else when `execute_model` (V1) / `sample_tokens` (V2, `sample_step`)
    returns; a step that raises before its logits writes nothing; no hook outlives the step.
  - Not recorded: padding rows (DP / graph sizes: the model's own `input_ids` tell the rows apart),
    the logits of speculative steps (rows per draft token), the drafter's forwards.
  Output: {RL_MSPROBE_RECORD_DIR}/rollout/{pid}/rec{K}.f32 + rec{K}.json (engine "vllm-v1" / "vllm-v2").

This file depends on nothing but the standard library, vLLM's objects (duck-typed) and,
lazily, torch, msprobe and the recorder beside it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

ENV_CONFIG = "MSPROBE_ROLLOUT_CONFIG"
ENV_RECORD_DIR = "RL_MSPROBE_RECORD_DIR"  # rl_msprobe_records.ENV_DIR, read here without importing it
SOURCE = "vllm"
LOG_NAME = "dispatch_log.jsonl"
_ATTR = "_rl_msprobe_dump"
_RECORDS_ATTR = "_rl_msprobe_records"


class RlMsprobeDumpError(RuntimeError):
    """MSPROBE_ROLLOUT_CONFIG is set but the dump cannot run as asked: one clear message."""


def config_path() -> str | None:
    return os.environ.get(ENV_CONFIG) or None


def record_dir() -> str | None:
    """The per-token records' root (RL_MSPROBE_RECORD_DIR), else None: then nothing is imported."""
    return os.environ.get(ENV_RECORD_DIR, "").strip() or None


def _read_dump_path(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise RlMsprobeDumpError(
            f"{ENV_CONFIG}={path} cannot be used ({exc}); fix the file or unset {ENV_CONFIG}."
        ) from None
    dump_path = config.get("dump_path") if isinstance(config, dict) else None
    if not isinstance(dump_path, str) or not dump_path:
        raise RlMsprobeDumpError(
            f"{ENV_CONFIG}={path}: the rollout msprobe config must set dump_path (an absolute folder)."
        )
    return dump_path


def _check_eager(runner, variable: str = ENV_CONFIG) -> None:
    model_config = getattr(runner, "model_config", None)
    if not getattr(model_config, "enforce_eager", False):
        raise RlMsprobeDumpError(
            f"{variable} is set but this vLLM engine does not run eagerly (enforce_eager=False): the "
            "layers of a compiled / CUDA-graph forward cannot be seen. Start vLLM with enforce_eager=True "
            f"(verl: actor_rollout_ref.rollout.enforce_eager=True), or unset {variable}."
        )


def _rank(service) -> int:
    rank = getattr(service, "current_rank", None)
    if isinstance(rank, int):
        return rank
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def _tp() -> tuple[int | None, int | None]:
    """(TP rank, TP size) of this worker from vLLM's parallel state; (None, None) without it."""
    try:
        from vllm.distributed import parallel_state

        group = parallel_state.get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:
        return None, None


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


def prompt_lengths(runner, req_ids) -> dict:
    """Request id -> prompt length (tokens the model runner prefills) of cached requests, read before
    the step updates the runner's state: the V1 runner's `requests` (per-request states), the V2
    runner's `req_states` (arrays by row: `prefill_len`, else `prompt_len`). Unknown ids are left out."""
    requests = getattr(runner, "requests", None)
    if hasattr(requests, "get"):  # V1
        found = {rid: _prompt_len(requests.get(rid)) for rid in req_ids if requests.get(rid) is not None}
        return {rid: n for rid, n in found.items() if n is not None}
    states = getattr(runner, "req_states", None)  # V2
    rows = getattr(states, "req_id_to_index", None)
    lengths = None
    for name in ("prefill_len", "prompt_len"):
        lengths = getattr(getattr(states, name, None), "np", None)
        if lengths is not None:
            break
    if not hasattr(rows, "get") or lengths is None:
        return {}
    return {rid: int(lengths[rows[rid]]) for rid in req_ids if rows.get(rid) is not None}


def dispatch(scheduler_output, requests=None) -> tuple[str, list[dict]]:
    """(phase, requests) of one scheduler step. `requests`: the cached requests' prompt lengths
    (`prompt_lengths`), or the V1 runner's request states (`runner.requests`), read before the step
    updates them."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    requests = requests if requests is not None else {}
    out: list[dict] = []
    prefill = False
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        rid = new.req_id
        computed = getattr(new, "num_computed_tokens", 0) or 0
        prompt = _prompt_len(new)
        prefill = prefill or prompt is None or computed < prompt
        out.append({"request_id": str(rid), "type": "new", "tokens": int(counts.get(rid, 0))})
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    ids = list(getattr(cached, "req_ids", None) or ())
    computed_list = list(getattr(cached, "num_computed_tokens", None) or ())
    for index, rid in enumerate(ids):
        state = requests.get(rid) if hasattr(requests, "get") else None
        prompt = state if isinstance(state, int) else (_prompt_len(state) if state is not None else None)
        computed = computed_list[index] if index < len(computed_list) else None
        if prompt is not None and computed is not None and computed < prompt:
            prefill = True
        out.append({"request_id": str(rid), "type": "cached", "tokens": int(counts.get(rid, 0))})
    return ("prefill" if prefill else "decode"), out


class _Dump:
    """One runner's dump state; the msprobe debugger itself is a per-process singleton."""

    def __init__(self, config: str) -> None:
        self.config = config
        self.base = _read_dump_path(config)
        self.pid = os.getpid()
        self.folder = os.path.join(self.base, str(self.pid))
        self.debugger = None
        self.pending: tuple[str, list[dict], int] | None = None
        self.started = False
        self.step = 0
        self.request_id = _read_request_id(config)
        self.sliced_out = False

    def _debugger(self):
        if self.debugger is None:
            try:
                from msprobe.pytorch import PrecisionDebugger
            except ImportError as exc:
                raise RlMsprobeDumpError(
                    f"{ENV_CONFIG} is set but msprobe is not importable here ({exc}): "
                    "pip install mindstudio-probe in the rollout's Python, or unset it."
                ) from None
            debugger = PrecisionDebugger(config_path=self.config)
            self.pid = os.getpid()  # the process that runs the model (the runner may predate a fork)
            self.folder = os.path.join(self.base, str(self.pid))
            debugger.service.config.dump_path = self.folder
            self.debugger = debugger
        return self.debugger

    def begin(self, runner, scheduler_output) -> None:
        self.started = False
        self.pending = None
        if scheduler_output is None or not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return
        if self.debugger is not None and getattr(self.debugger.service, "should_stop_service", False):
            return  # every configured step is done: the rest of the run costs one check per step
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        lengths = prompt_lengths(runner, list(getattr(cached, "req_ids", None) or ()))
        phase, requests = dispatch(scheduler_output, lengths)
        if phase == "decode" and os.environ.get("MSPROBE_ROLLOUT_PHASES", "").strip() == "prefill":
            return  # a prefill-only consistency run: the decode steps are not compared
        self.pending = (phase, requests, int(scheduler_output.total_num_scheduled_tokens))

    def start(self, runner) -> None:
        if self.pending is None or self.started:
            return
        debugger = self._debugger()
        if getattr(debugger.service, "should_stop_service", False):
            self.pending = None  # every configured step is done: no more work per step
            return
        tokens = request_slice(runner, self.request_id, self.pending) if self.request_id else None
        self.sliced_out = tokens is not None and self.request_id not in tokens
        if tokens is None:
            debugger.start(model=runner.model)
        else:  # msprobe >= 26.2
            debugger.start(model=runner.model, scheduled_tokens=tokens)
        self.started = True
        self.step = int(getattr(debugger.service, "current_iter", 0))

    def _dumping(self) -> bool:
        service = self.debugger.service
        config = getattr(service, "config", None)
        if getattr(service, "should_stop_service", False):
            return False
        steps = getattr(config, "step", None)
        if steps and self.step not in steps:
            return False
        ranks = getattr(config, "rank", None)
        return not (ranks and getattr(service, "current_rank", None) not in ranks)

    def finish(self, failed: bool = False) -> None:
        if not self.started:
            return
        self.started = False
        pending, self.pending = self.pending, None
        debugger = self.debugger
        try:
            if self._dumping() and pending is not None and not self.sliced_out:
                self._log(*pending)
        except Exception as exc:
            if not failed:
                raise
            print(f"rl-msprobe: dispatch log not written for step {self.step}: {exc}", file=sys.stderr)
        finally:
            if not failed:
                debugger.stop()
                debugger.step()
            else:  # execute_model is raising: keep its exception the one that propagates
                try:
                    debugger.stop()
                    debugger.step()
                except Exception as exc:
                    print(f"rl-msprobe: msprobe stop/step failed after an error: {exc}", file=sys.stderr)

    def _log(self, phase: str, requests: list[dict], total: int) -> None:
        os.makedirs(self.folder, exist_ok=True)
        tp_rank, tp_size = _tp()
        line = {
            "source": SOURCE,
            "timestamp": time.time(),
            "pid": self.pid,
            "rank": _rank(self.debugger.service),
            "step": self.step,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "phase": phase,
            "total_num_scheduled_tokens": total,
            "requests": requests,
        }
        with open(os.path.join(self.folder, LOG_NAME), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")


class _Records:
    """The per-token records of one runner (`rl_msprobe_records.py`, beside this file): one record per
    model step that serves a selected request, cut out of the batched forward by the step's own batch
    metadata. A step with no selected request installs no hook."""

    def __init__(self) -> None:
        from vllm.v1.worker import rl_msprobe_records

        self.lib = rl_msprobe_records
        self.scheduler_output = None
        self.recorder = None
        self.engine = "vllm-v1"

    def begin(self, scheduler_output) -> None:
        self.scheduler_output = scheduler_output

    def start(self, runner, input_batch=None) -> None:
        scheduler_output, self.scheduler_output = self.scheduler_output, None
        if self.recorder is not None or scheduler_output is None:
            return
        if input_batch is not None:
            self.engine = "vllm-v2"
            layout, phase = v2_layout(self.lib, input_batch)
        else:
            self.engine = "vllm-v1"
            layout, phase = self.lib.vllm_v1_layout(runner.input_batch, scheduler_output)
        if layout is None or layout.empty():
            return  # no selected request in this step: no hook, no cost
        tp_rank, tp_size = _tp()
        meta = {"rank": _global_rank(), "tp_rank": tp_rank, "tp_size": tp_size, "phase": phase,
                "engine": self.engine}  # fmt: skip
        recorder = self.lib.Recorder(runner.model, layout, "rollout", meta)
        self.lib.watch_rows(recorder, runner.model)
        logits = getattr(runner.model, "logits_processor", None)
        if logits is not None:  # the step's logits are its last rows: later calls (prompt logprobs) are not
            recorder.handles.append(logits.register_forward_hook(lambda module, args, output: self.finish()))
        self.recorder = recorder

    def keep_for_sampling(self, runner, result) -> bool:
        """After the V2 runner's execute_model: keep the record open for sample_tokens (the logits)?
        Only when that runner left a step to sample (`execute_model_state`)."""
        return (
            self.recorder is not None
            and self.engine == "vllm-v2"
            and result is None
            and getattr(runner, "execute_model_state", None) is not None
            and _samples_wrapped(runner)
        )

    def finish(self, failed: bool = False) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return
        if failed:
            recorder.remove()  # the step failed: its rows are not a record
            return
        recorder.finish()


def v2_layout(lib, input_batch):
    """(Layout, phase) of a V2 step from its `InputBatch`: `req_ids` in row order (the V2 runner sorts
    them), `num_scheduled_tokens` rows each from `query_start_loc_np`, positions from
    `num_computed_tokens_np`, the logits' rows one per request without drafts (`cu_num_logits`)."""
    req_ids = list(input_batch.req_ids)
    prefilling = getattr(input_batch, "is_prefilling_np", None)
    prefill = int(sum(bool(v) for v in prefilling[: len(req_ids)])) if prefilling is not None else 0
    drafts = int(getattr(input_batch, "num_draft_tokens", 0) or 0)
    total = getattr(input_batch, "num_tokens_after_padding", None)
    layout = lib.batch_layout(
        req_ids,
        input_batch.num_scheduled_tokens[: len(req_ids)],
        input_batch.num_computed_tokens_np[: len(req_ids)],
        total=int(total) if total else None,
        starts=getattr(input_batch, "query_start_loc_np", None),
        samples=not drafts,
    )
    return layout, lib.phase(prefill, len(req_ids) - prefill)


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


# ---------------------------------------------------------------- msprobe's per-request slice


def _read_request_id(path: str) -> str | None:
    """The rollout config's `request_id` (in its task section), else None."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
        section = config.get(config.get("task") or "statistics") or {}
        rid = section.get("request_id") if isinstance(section, dict) else None
    except (OSError, ValueError, AttributeError):
        return None
    return str(rid) if rid else None


def _base_id(request_id) -> str:
    """verl's id (the one rule, in rl_msprobe_records.base_id beside this file)."""
    from vllm.v1.worker import rl_msprobe_records

    return rl_msprobe_records.base_id(request_id)


def request_slice(runner, wanted: str, pending) -> dict:
    """msprobe's `scheduled_tokens` for this step: {base id: scheduled tokens} in the V1 runner's row
    order (`runner.input_batch.req_ids`; the forward's rows are the requests' tokens in that order).
    With MSPROBE_ROLLOUT_PHASES=prefill a step where WANTED decodes keys it apart (not dumped). A
    prefill of WANTED split over steps (chunked prefill) is refused: msprobe would dump each chunk
    as a step of its own, and none of them is the prompt the training side computes."""
    order = list(getattr(getattr(runner, "input_batch", None), "req_ids", None) or ())
    if not order:
        raise RlMsprobeDumpError(
            f"{ENV_CONFIG}: the config sets request_id, but this runner has no V1 input_batch.req_ids (the V2 "
            "model runner): msprobe's per-request slice needs the rows' request order. Remove request_id from "
            "the rollout config, or run the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)."
        )
    phase, requests, total = pending
    counts = {item["request_id"]: item["tokens"] for item in requests}
    tokens: dict = {}
    for rid in order:
        if counts.get(rid):
            tokens[_base_id(rid)] = int(counts[rid])
    if sum(tokens.values()) != total:
        raise RlMsprobeDumpError(
            f"{ENV_CONFIG}: the runner's rows ({sum(tokens.values())} scheduled tokens of input_batch.req_ids) "
            f"are not the step's {total}: msprobe's request slice would cut the wrong rows."
        )
    if wanted in tokens and phase == "prefill":
        _refuse_chunked(runner, wanted, tokens[wanted], requests)
    if (
        wanted in tokens
        and phase == "decode"
        and os.environ.get("MSPROBE_ROLLOUT_PHASES", "").strip() == "prefill"
    ):
        tokens[f"{wanted}#decode"] = tokens.pop(wanted)
    return tokens


def _refuse_chunked(runner, wanted: str, count: int, requests) -> None:
    rid = next((item["request_id"] for item in requests if _base_id(item["request_id"]) == wanted), None)
    state = (
        getattr(runner, "requests", {}).get(rid)
        if hasattr(getattr(runner, "requests", None), "get")
        else None
    )
    prompt = _prompt_len(state) if state is not None else None
    computed = getattr(state, "num_computed_tokens", None)
    if prompt is None or not isinstance(computed, int) or computed >= prompt:
        return  # a decode row in a mixed step (or nothing known): not a prefill chunk
    if computed > 0 or computed + count < prompt:
        raise RlMsprobeDumpError(
            f"{ENV_CONFIG}: request {wanted}'s prompt ({prompt} tokens) is prefilled in chunks ({count} tokens "
            f"from position {computed}): msprobe's slice dumps one chunk per step, never the whole prompt the "
            "training side computes. Raise max_num_batched_tokens above the prompt length (verl: "
            "actor_rollout_ref.rollout.max_num_batched_tokens) or disable chunked prefill, and run again."
        )


# ---------------------------------------------------------------- called from the marked lines


def init_runner(runner) -> None:
    """Last line of GPUModelRunner.__init__ (V1 and V2): check eager execution and the config, early
    (msprobe's dump and the per-token records each ask for it; either may be on, or both)."""
    config = config_path()
    recording = record_dir() is not None
    if config is None and not recording:
        return
    _check_eager(runner, ENV_CONFIG if config is not None else ENV_RECORD_DIR)
    if config is not None:
        setattr(runner, _ATTR, _Dump(config))
    if recording:
        setattr(runner, _RECORDS_ATTR, _Records())


def _state(runner) -> _Dump | None:
    dump = getattr(runner, _ATTR, None)
    if dump is None and config_path() is not None:
        init_runner(runner)  # a subclass that skipped GPUModelRunner.__init__'s last line
        dump = getattr(runner, _ATTR, None)
    return dump


def _records_state(runner) -> _Records | None:
    records = getattr(runner, _RECORDS_ATTR, None)
    if records is None and record_dir() is not None:
        init_runner(runner)
        records = getattr(runner, _RECORDS_ATTR, None)
    return records


def _finish_all(dump: _Dump | None, records: _Records | None, failed: bool) -> None:
    """Finish the records, then msprobe's step: each runs even when the other raises."""
    try:
        if records is not None:
            records.finish(failed=failed)
    finally:
        if dump is not None:
            dump.finish(failed=failed)


def dump_step(execute_model):
    """Decorator for GPUModelRunner.execute_model (V1 and V2): one msprobe step per model step,
    stopped and stepped on every way out (each return and any exception), and the step's per-token
    record written (its hooks removed) on every way out too. The V2 runner's dummy runs
    (`dummy_run=True`: warm-up, profiling, DP padding) are not model steps and never dumped."""

    @functools.wraps(execute_model)
    def execute_model_with_dump(self, *args, **kwargs):
        dump = _state(self)
        records = _records_state(self)
        if (dump is None and records is None) or kwargs.get("dummy_run"):
            return execute_model(self, *args, **kwargs)
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        if records is not None:
            records.finish()  # a V2 step whose sample_tokens never came: its forward's record, written now
            records.begin(scheduler_output)
        if dump is not None:
            dump.begin(self, scheduler_output)
        try:
            result = execute_model(self, *args, **kwargs)
        except BaseException:
            _finish_all(dump, records, failed=True)
            raise
        if records is not None and records.keep_for_sampling(self, result):
            records = None  # the V2 runner computes this step's logits in sample_tokens: it finishes there
        _finish_all(dump, records, failed=False)
        return result

    return execute_model_with_dump


def sample_step(sample_tokens):
    """Decorator for the V2 runner's GPUModelRunner.sample_tokens: the logits of the step that
    execute_model ran are computed here (`runner.model.compute_logits`), under the same record's
    hooks; the record is written (its hooks removed) on every way out of sample_tokens."""

    @functools.wraps(sample_tokens)
    def sample_tokens_with_records(self, *args, **kwargs):
        records = getattr(self, _RECORDS_ATTR, None)
        if records is None or records.recorder is None:
            return sample_tokens(self, *args, **kwargs)
        try:
            result = sample_tokens(self, *args, **kwargs)
        except BaseException:
            records.finish(failed=True)
            raise
        records.finish()
        return result

    sample_tokens_with_records._rl_msprobe_dump_sample_step = True  # type: ignore[attr-defined]
    return sample_tokens_with_records


def _samples_wrapped(runner) -> bool:
    """Is sample_tokens decorated by sample_step in the runner's classes? (Else a V2 record is written
    when execute_model returns, without the logits; a record left open is written at the next step.)"""
    return any(
        getattr(cls.__dict__.get("sample_tokens"), "_rl_msprobe_dump_sample_step", False)
        for cls in type(runner).__mro__
    )


def start_forward(runner, input_batch=None) -> None:
    """Just before the model forward in execute_model: start the debugger on runner.model, and the
    per-token record of the step's selected requests. INPUT_BATCH: the V2 runner's batch of this step
    (its requests in row order, their scheduled and computed tokens); the V1 runner's is
    `runner.input_batch` with the scheduler output's token counts."""
    records = getattr(runner, _RECORDS_ATTR, None)
    if records is not None:
        records.start(runner, input_batch)
    dump = getattr(runner, _ATTR, None)
    if dump is not None:
        dump.start(runner)

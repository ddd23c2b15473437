"""The helper file vllm-dump adds to vLLM (`vllm/v1/worker/rl_msprobe_dump.py`), on its own.

Runners and scheduler outputs are stand-ins shaped like vLLM 0.24-0.34's (V1 and V2 runners)
(`SchedulerOutput.scheduled_new_reqs` / `scheduled_cached_reqs.req_ids` /
`num_scheduled_tokens`, `CachedRequestState.num_prompt_tokens`); the debugger is a stand-in
with msprobe's step semantics, and one test runs the real msprobe on a tiny torch model.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.support.trees import DISPATCH_LOG_KEYS

HELPER = (
    Path(__file__).resolve().parents[3] / "rl_msprobe/patches/files/vllm/vllm/v1/worker/rl_msprobe_dump.py"
)


def load_helper():
    spec = importlib.util.spec_from_file_location("rl_msprobe_dump_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- stand-ins


def new_req(rid, prompt, computed=0, embeds=None):
    return NS(req_id=rid, prompt_token_ids=None if prompt is None else list(range(prompt)), num_computed_tokens=computed,
              prompt_embeds=embeds)  # fmt: skip


def sched(new=(), cached=(), counts=None):
    """cached: (request id, tokens computed before this step)."""
    counts = counts or {}
    cached_data = NS(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached])
    return NS(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_data,
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
    )


class FakeService:
    """msprobe's Service as far as the helper sees it (step semantics of mindstudio-probe 26.2)."""

    def __init__(self, steps=(), ranks=()):
        self.config = NS(step=list(steps), rank=list(ranks), dump_path=None)
        self.current_iter = 0
        self.current_rank = 0
        self.should_stop_service = False


class FakeDebugger:
    instances: list[FakeDebugger] = []

    def __init__(self, config_path=None, steps=(), ranks=()):
        self.config_path = config_path
        self.service = FakeService(steps, ranks)
        self.calls: list[tuple] = []
        FakeDebugger.instances.append(self)

    def start(self, model=None, rank_id=None):
        svc = self.service
        if svc.config.step and svc.current_iter > max(svc.config.step):
            svc.should_stop_service = True
        self.calls.append(("start", svc.current_iter, model))

    def stop(self):
        self.calls.append(("stop", self.service.current_iter))

    def step(self):
        self.calls.append(("step", self.service.current_iter))
        if not self.service.should_stop_service:
            self.service.current_iter += 1


@pytest.fixture
def fake_msprobe(monkeypatch):
    """A stand-in `msprobe.pytorch` whose PrecisionDebugger is a FakeDebugger (steps via FAKE_STEPS)."""
    FakeDebugger.instances = []
    steps: list[int] = []
    package = types.ModuleType("msprobe")
    pytorch = types.ModuleType("msprobe.pytorch")
    pytorch.PrecisionDebugger = lambda config_path=None: FakeDebugger(config_path, steps)
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "msprobe", package)
    monkeypatch.setitem(sys.modules, "msprobe.pytorch", pytorch)
    return steps


@pytest.fixture
def config(tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "statistics", "level": "mix", "dump_path": str(dump)}))
    monkeypatch.setenv("MSPROBE_ROLLOUT_CONFIG", str(path))
    return dump


def make_runner_class(helper):
    """A runner shaped like GPUModelRunner after vllm-dump: init_runner last in __init__, the
    decorator on execute_model, start_forward right before the forward."""

    class Runner:
        def __init__(self, eager=True):
            self.model_config = NS(enforce_eager=eager)
            self.model = object()
            self.requests = {}
            self.forwards = 0
            helper.init_runner(self)

        @helper.dump_step
        def execute_model(self, scheduler_output, intermediate_tensors=None, mode="normal"):
            if not scheduler_output.total_num_scheduled_tokens:
                return "EMPTY"  # no work: returns before the forward
            if mode == "fail-before":
                raise ValueError("before the forward")
            helper.start_forward(self)
            self.forwards += 1
            if mode == "fail-after":
                raise ValueError("after the forward")
            if mode == "pp":
                return "intermediate tensors"  # a non-last pipeline rank
            for new in scheduler_output.scheduled_new_reqs:
                self.requests[new.req_id] = NS(num_prompt_tokens=len(new.prompt_token_ids or ()))
            return None

    return Runner


def log_lines(dump: Path) -> list[dict]:
    files = list(dump.glob("*/dispatch_log.jsonl"))
    if not files:
        return []
    (log,) = files
    return [json.loads(line) for line in log.read_text().splitlines()]


# ---------------------------------------------------------------- phase and requests


def test_first_step_of_new_prompts_is_prefill_with_their_ids():
    helper = load_helper()
    out = sched(
        new=[new_req("0-ab12cd34", 5), new_req("1-ef56ab78", 3)], counts={"0-ab12cd34": 5, "1-ef56ab78": 3}
    )
    phase, requests = helper.dispatch(out)
    assert phase == "prefill"
    assert requests == [
        {"request_id": "0-ab12cd34", "type": "new", "tokens": 5},
        {"request_id": "1-ef56ab78", "type": "new", "tokens": 3},
    ]


def test_plain_decode_and_speculative_decode_are_decode():
    helper = load_helper()
    states = {"a": NS(num_prompt_tokens=5), "b": NS(num_prompt_tokens=3)}
    phase, requests = helper.dispatch(sched(cached=[("a", 5), ("b", 3)], counts={"a": 1, "b": 1}), states)
    assert phase == "decode" and [r["type"] for r in requests] == ["cached", "cached"]
    # speculative decoding: several tokens per request, none of them prompt tokens
    phase, requests = helper.dispatch(sched(cached=[("a", 9)], counts={"a": 4}), states)
    assert phase == "decode" and requests == [{"request_id": "a", "type": "cached", "tokens": 4}]


def test_chunked_prefill_continuation_and_mixed_steps_are_prefill():
    helper = load_helper()
    states = {"long": NS(num_prompt_tokens=100), "short": NS(num_prompt_tokens=4)}
    # the second chunk of a long prompt: a cached request still computing prompt tokens
    assert helper.dispatch(sched(cached=[("long", 64)], counts={"long": 36}), states)[0] == "prefill"
    # one request decodes while another's prompt is computed
    mixed = sched(cached=[("short", 6), ("long", 64)], counts={"short": 1, "long": 36})
    assert helper.dispatch(mixed, states)[0] == "prefill"


def test_prefix_cached_and_resumed_requests():
    helper = load_helper()
    # a new request whose prompt is partly prefix-cached still computes prompt tokens
    assert helper.dispatch(sched(new=[new_req("r", 10, computed=8)], counts={"r": 2}))[0] == "prefill"
    # a prompt given as embeddings (no token ids)
    embeds = NS(shape=(7, 128))
    assert helper.dispatch(sched(new=[new_req("e", None, embeds=embeds)], counts={"e": 7}))[0] == "prefill"
    # resumed after preemption as a cached request: recomputes from zero
    assert (
        helper.dispatch(sched(cached=[("p", 0)], counts={"p": 9}), {"p": NS(num_prompt_tokens=6)})[0]
        == "prefill"
    )
    # a cached request the runner does not know: not evidence of a prefill
    assert helper.dispatch(sched(cached=[("x", 3)], counts={"x": 1}), {})[0] == "decode"


# ---------------------------------------------------------------- off, refusals


def test_unset_env_does_nothing_and_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MSPROBE_ROLLOUT_CONFIG", raising=False)
    monkeypatch.setitem(sys.modules, "msprobe", None)  # any import of msprobe would raise
    monkeypatch.setitem(sys.modules, "msprobe.pytorch", None)
    monkeypatch.chdir(tmp_path)
    helper = load_helper()
    runner = make_runner_class(helper)(eager=False)  # even a non-eager engine is fine when off
    assert runner.execute_model(sched(new=[new_req("a", 3)], counts={"a": 3})) is None
    assert runner.execute_model(sched()) == "EMPTY"
    assert not hasattr(runner, "_rl_msprobe_dump") and runner.forwards == 1
    assert list(tmp_path.iterdir()) == []


def test_non_eager_engine_is_refused(config, fake_msprobe):
    helper = load_helper()
    with pytest.raises(helper.RlMsprobeDumpError, match=r"enforce_eager=True"):
        make_runner_class(helper)(eager=False)
    assert FakeDebugger.instances == []


def test_config_without_dump_path_is_refused(tmp_path, monkeypatch, fake_msprobe):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "statistics", "level": "mix"}))
    monkeypatch.setenv("MSPROBE_ROLLOUT_CONFIG", str(path))
    helper = load_helper()
    with pytest.raises(helper.RlMsprobeDumpError, match="dump_path"):
        make_runner_class(helper)()
    monkeypatch.setenv("MSPROBE_ROLLOUT_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(helper.RlMsprobeDumpError, match="missing.json"):
        make_runner_class(helper)()


# ---------------------------------------------------------------- the V2 runner (vllm/v1/worker/gpu/model_runner.py)


class Lengths:
    """vLLM's UvaBackedTensor as far as the helper reads it: a numpy view `.np` (rows by request index)."""

    def __init__(self, values):
        import numpy as np

        self.np = np.array(values, dtype=np.int32)


def make_v2_runner_class(helper):
    """A runner shaped like the V2 GPUModelRunner after vllm-dump: request state in `req_states`
    (`req_id_to_index`, `prefill_len` / `prompt_len` arrays), no `requests`, dummy runs through
    `execute_model(..., dummy_run=True)`."""

    class RunnerV2:
        def __init__(self):
            self.model_config = NS(enforce_eager=True)
            self.model = object()
            self.req_states = NS(
                req_id_to_index={}, prefill_len=Lengths([0] * 8), prompt_len=Lengths([0] * 8)
            )
            self.forwards = 0
            helper.init_runner(self)

        @helper.dump_step
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            if not dummy_run:
                for new in scheduler_output.scheduled_new_reqs:  # add_requests: a row per new request
                    row = len(self.req_states.req_id_to_index)
                    self.req_states.req_id_to_index[new.req_id] = row
                    self.req_states.prefill_len.np[row] = len(new.prompt_token_ids)
                if not scheduler_output.total_num_scheduled_tokens:
                    return "EMPTY"
            helper.start_forward(self)
            self.forwards += 1
            return None

    return RunnerV2


def test_v2_runner_dumps_each_model_step_and_never_its_dummy_runs(config, fake_msprobe):
    helper = load_helper()
    runner = make_v2_runner_class(helper)()
    assert runner.execute_model(sched(), dummy_run=True) is None  # warm-up: a forward, not a model step
    assert runner.execute_model(sched(new=[new_req("long", 100)], counts={"long": 64})) is None
    assert runner.execute_model(sched(cached=[("long", 64)], counts={"long": 36})) is None  # 2nd chunk
    assert runner.execute_model(sched(cached=[("long", 100)], counts={"long": 1})) is None
    assert runner.forwards == 4
    (debugger,) = FakeDebugger.instances
    assert [c[0] for c in debugger.calls] == ["start", "stop", "step"] * 3
    lines = log_lines(config)
    assert [(x["step"], x["phase"]) for x in lines] == [(0, "prefill"), (1, "prefill"), (2, "decode")]
    assert lines[1]["requests"] == [{"request_id": "long", "type": "cached", "tokens": 36}]


def test_prompt_lengths_read_either_runner(config):
    helper = load_helper()
    v1 = NS(requests={"a": NS(num_prompt_tokens=5)})
    assert helper.prompt_lengths(v1, ["a", "gone"]) == {"a": 5}
    v2 = NS(req_states=NS(req_id_to_index={"a": 1}, prefill_len=Lengths([0, 7]), prompt_len=Lengths([0, 5])))
    assert helper.prompt_lengths(v2, ["a", "gone"]) == {"a": 7}  # prefill_len: a resumed request's too
    only_prompt = NS(req_states=NS(req_id_to_index={"a": 0}, prompt_len=Lengths([6])))
    assert helper.prompt_lengths(only_prompt, ["a"]) == {"a": 6}
    assert helper.prompt_lengths(NS(), ["a"]) == {}  # neither shape: no evidence, no guess


# ---------------------------------------------------------------- one step per model step, every exit


def test_one_dump_step_per_forward_and_a_log_line_each(config, fake_msprobe):
    helper = load_helper()
    runner = make_runner_class(helper)()
    assert (
        runner.execute_model(sched(new=[new_req("a", 4), new_req("b", 2)], counts={"a": 4, "b": 2})) is None
    )
    assert runner.execute_model(sched()) == "EMPTY"  # nothing scheduled: no step
    assert runner.execute_model(sched(cached=[("a", 4), ("b", 2)], counts={"a": 1, "b": 1})) is None
    (debugger,) = FakeDebugger.instances
    assert [c[:2] for c in debugger.calls] == [
        ("start", 0),
        ("stop", 0),
        ("step", 0),
        ("start", 1),
        ("stop", 1),
        ("step", 1),
    ]
    assert debugger.calls[0][2] is runner.model
    assert debugger.service.config.dump_path == str(config / str(runner._rl_msprobe_dump.pid))
    lines = log_lines(config)
    assert [(x["step"], x["phase"], x["total_num_scheduled_tokens"]) for x in lines] == [
        (0, "prefill", 6),
        (1, "decode", 2),
    ]
    # the vLLM helper also says which tensor-parallel rank of how many wrote the line (None: no TP group)
    assert set(lines[0]) == {*DISPATCH_LOG_KEYS, "tp_rank", "tp_size"}
    assert lines[0]["source"] == "vllm" and lines[0]["rank"] == 0
    assert (lines[0]["tp_rank"], lines[0]["tp_size"]) == (None, None)
    assert [r["request_id"] for r in lines[0]["requests"]] == ["a", "b"]


def test_prefill_only_runs_the_decode_steps_undumped(config, fake_msprobe, monkeypatch):
    """MSPROBE_ROLLOUT_PHASES=prefill (prepare --mode consistency --prefill-only): a decode step is
    neither dumped nor logged, and msprobe's step advances with the prefills only."""
    monkeypatch.setenv("MSPROBE_ROLLOUT_PHASES", "prefill")
    helper = load_helper()
    runner = make_runner_class(helper)()
    runner.execute_model(sched(new=[new_req("a", 4)], counts={"a": 4}))
    runner.execute_model(sched(cached=[("a", 4)], counts={"a": 1}))
    runner.execute_model(sched(new=[new_req("b", 3)], counts={"b": 3}))
    (debugger,) = FakeDebugger.instances
    assert [c[:2] for c in debugger.calls] == [("start", 0), ("stop", 0), ("step", 0)] + [
        ("start", 1),
        ("stop", 1),
        ("step", 1),
    ]
    assert [(x["step"], x["phase"]) for x in log_lines(config)] == [(0, "prefill"), (1, "prefill")]


@pytest.mark.parametrize("mode", ["pp", "fail-after"])
def test_stopped_and_stepped_on_other_exits(config, fake_msprobe, mode):
    helper = load_helper()
    runner = make_runner_class(helper)()
    out = sched(new=[new_req("a", 4)], counts={"a": 4})
    if mode == "fail-after":
        with pytest.raises(ValueError, match="after the forward"):
            runner.execute_model(out, mode=mode)
    else:
        assert runner.execute_model(out, mode=mode) == "intermediate tensors"
    (debugger,) = FakeDebugger.instances
    assert [c[0] for c in debugger.calls] == ["start", "stop", "step"]
    assert len(log_lines(config)) == 1
    # the next step starts clean
    runner.execute_model(sched(cached=[("a", 4)], counts={"a": 1}))
    assert [c[:2] for c in debugger.calls[3:]] == [("start", 1), ("stop", 1), ("step", 1)]


def test_failure_before_the_forward_dumps_nothing(config, fake_msprobe):
    helper = load_helper()
    runner = make_runner_class(helper)()
    with pytest.raises(ValueError, match="before the forward"):
        runner.execute_model(sched(new=[new_req("a", 4)], counts={"a": 4}), mode="fail-before")
    assert FakeDebugger.instances == [] or FakeDebugger.instances[0].calls == []
    assert log_lines(config) == []


def test_only_configured_steps_are_logged_and_work_stops_after_the_last(config, fake_msprobe):
    fake_msprobe.extend([1, 2])
    helper = load_helper()
    seen = []
    dispatch = helper.dispatch
    helper.dispatch = lambda *a: seen.append(1) or dispatch(*a)
    runner = make_runner_class(helper)()
    runner.execute_model(sched(new=[new_req("a", 4)], counts={"a": 4}))
    for _ in range(5):
        runner.execute_model(sched(cached=[("a", 4)], counts={"a": 1}))
    (debugger,) = FakeDebugger.instances
    assert [x["step"] for x in log_lines(config)] == [1, 2]
    assert debugger.service.should_stop_service
    starts = [c for c in debugger.calls if c[0] == "start"]
    assert len(starts) == 4, "after the service stopped for good, no more start/stop per step"
    assert len(seen) == 4, "nor any reading of the scheduler output"
    assert runner.forwards == 6


def test_real_msprobe_dumps_through_the_helper(tmp_path):
    """The helper drives the real msprobe (mindstudio-probe) on a tiny torch model: one
    step{N} folder with real statistics per model step, and the dispatch log beside them."""
    pytest.importorskip("torch")
    pytest.importorskip("msprobe")
    dump = tmp_path / "dump"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"task": "statistics", "dump_path": str(dump), "rank": [], "step": [], "level": "mix",
             "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}
        )
    )  # fmt: skip
    script = textwrap.dedent(
        f"""
        import importlib.util, json
        from types import SimpleNamespace as NS
        import torch
        spec = importlib.util.spec_from_file_location("helper", {str(HELPER)!r})
        helper = importlib.util.module_from_spec(spec); spec.loader.exec_module(helper)

        class Runner:
            def __init__(self):
                self.model_config = NS(enforce_eager=True)
                torch.manual_seed(0)
                self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
                self.requests = {{}}
                helper.init_runner(self)

            @helper.dump_step
            def execute_model(self, scheduler_output):
                helper.start_forward(self)
                with torch.no_grad():
                    return self.model(torch.randn(scheduler_output.total_num_scheduled_tokens, 8))

        runner = Runner()
        new = NS(req_id="0-1234abcd", prompt_token_ids=[1, 2, 3], num_computed_tokens=0)
        first = NS(scheduled_new_reqs=[new], scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
                   num_scheduled_tokens={{"0-1234abcd": 3}}, total_num_scheduled_tokens=3)
        runner.execute_model(first)
        runner.requests["0-1234abcd"] = NS(num_prompt_tokens=3)
        for _ in range(2):
            runner.execute_model(NS(scheduled_new_reqs=[], num_scheduled_tokens={{"0-1234abcd": 1}},
                                    scheduled_cached_reqs=NS(req_ids=["0-1234abcd"], num_computed_tokens=[3]),
                                    total_num_scheduled_tokens=1))
        print("DONE")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MSPROBE_")}
    env["MSPROBE_ROLLOUT_CONFIG"] = str(config)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    (pid_dir,) = [p for p in dump.iterdir() if p.is_dir()]
    steps = sorted(p.name for p in pid_dir.glob("step*"))
    assert steps == ["step0", "step1", "step2"]
    dumps = sorted(pid_dir.glob("step*/*/dump.json"))
    assert len(dumps) == 3
    data = json.loads(dumps[0].read_text())["data"]
    linear = [k for k in data if k.startswith("Module.") and "Linear" in k]
    assert linear, list(data)[:10]
    assert data[linear[0]]["output"][0]["shape"] == [3, 16]
    assert isinstance(data[linear[0]]["output"][0]["Max"], float)
    lines = [json.loads(x) for x in (pid_dir / "dispatch_log.jsonl").read_text().splitlines()]
    assert [(x["step"], x["phase"]) for x in lines] == [(0, "prefill"), (1, "decode"), (2, "decode")]
    assert lines[0]["requests"] == [{"request_id": "0-1234abcd", "type": "new", "tokens": 3}]
    assert lines[0]["pid"] == int(pid_dir.name)


def test_the_engine_error_wins_over_a_failing_stop(config, fake_msprobe, monkeypatch, capsys):
    helper = load_helper()
    runner = make_runner_class(helper)()

    def broken_stop(self):
        raise RuntimeError("msprobe could not flush")

    monkeypatch.setattr(FakeDebugger, "stop", broken_stop)
    with pytest.raises(ValueError, match="after the forward"):
        runner.execute_model(sched(new=[new_req("a", 4)], counts={"a": 4}), mode="fail-after")
    assert "msprobe could not flush" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="msprobe could not flush"):  # without an engine error: loud
        runner.execute_model(sched(new=[new_req("b", 4)], counts={"b": 4}))


def test_missing_msprobe_is_a_clear_error(config, monkeypatch):
    monkeypatch.setitem(sys.modules, "msprobe", None)
    monkeypatch.setitem(sys.modules, "msprobe.pytorch", None)
    helper = load_helper()
    runner = make_runner_class(helper)()
    with pytest.raises(helper.RlMsprobeDumpError, match="pip install mindstudio-probe"):
        runner.execute_model(sched(new=[new_req("a", 4)], counts={"a": 4}))

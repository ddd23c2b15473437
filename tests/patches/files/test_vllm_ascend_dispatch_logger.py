"""The dispatch-logger file added to vLLM-Ascend trees, on its own.

Scheduler outputs are built in the shapes vLLM's V1 scheduler has produced (written for these
tests from the field names, not copied): new requests (`NewRequestData`), cached requests as
one `CachedRequestData` with parallel lists (vLLM >= 0.9.2, every vLLM-Ascend with msprobe
support) or as a list of per-request objects (before 0.9.2), decode-only steps, chunked
prefill, preemption, speculative decoding. Debuggers are msprobe's two shapes: a
`PrecisionDebugger` (with `.service`) and an `AclGraphDumper` (without). The last test runs
the real msprobe.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from enum import Enum
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from rl_msprobe.patches import get_set
from tests.support.trees import DISPATCH_LOG_KEYS

FILE = (
    Path(__file__).resolve().parents[3]
    / "rl_msprobe/patches/files/vllm_ascend/vllm_ascend/worker/dispatch_logger.py"
)


def _load():
    spec = importlib.util.spec_from_file_location("dispatch_logger_under_test", FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dl = _load()


class AscendAttentionState(Enum):  # the values of vllm_ascend.attention.attention_v1's enum
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


# ---------------------------------------------------------------- scheduler-output shapes


def new_req(rid, prompt_len, computed=0):
    return NS(req_id=rid, prompt_token_ids=list(range(prompt_len)), num_computed_tokens=computed)


def cached_v092(ids, computed):
    """vLLM >= 0.9.2: one CachedRequestData with parallel lists."""
    return NS(
        req_ids=list(ids),
        num_computed_tokens=list(computed),
        resumed_from_preemption=[False] * len(ids),
        new_token_ids=[[] for _ in ids],
    )


def cached_pre092(ids, computed):
    """vLLM < 0.9.2: a list of per-request CachedRequestData."""
    return [
        NS(req_id=rid, num_computed_tokens=c, resumed_from_preemption=False) for rid, c in zip(ids, computed)
    ]


def sched(new=(), cached=None, tokens=None, spec=None):
    tokens = dict(tokens or {})
    return NS(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached if cached is not None else cached_v092([], []),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=dict(spec or {}),
    )


def states(**prompt_lens):
    """runner.requests: CachedRequestState-like objects with num_prompt_tokens."""
    return {rid: NS(num_prompt_tokens=n, num_computed_tokens=0) for rid, n in prompt_lens.items()}


# ---------------------------------------------------------------- debugger shapes


class FakeService:
    def __init__(self, dump_path, steps=(), ranks=()):
        self.config = NS(dump_path=dump_path, step=list(steps), rank=list(ranks))
        self.current_iter = 0
        self.current_rank = 0
        self.should_stop_service = False


class FakePrecisionDebugger:
    def __init__(self, dump_path, steps=(), ranks=()):
        self.service = FakeService(dump_path, steps, ranks)

    def step(self):
        self.service.current_iter += 1


class FakeAclGraphDumper:
    def __init__(self, dump_path):
        self.dump_path = dump_path
        self.step_id = 0
        self.rank_id = 3
        self._running = True
        self.dump_enable = True


def runner_with(debugger, **extra):
    return NS(debugger=debugger, **extra)


def read_log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / dl.LOG_NAME).read_text().splitlines()]


# ---------------------------------------------------------------- requests and phase


def test_first_step_new_requests_only_is_prefill():
    so = sched(new=[new_req("a-1f2e3d4c", 5), new_req("b", 7)], tokens={"a-1f2e3d4c": 5, "b": 7})
    assert dl.scheduled_requests(so) == [
        {"request_id": "a-1f2e3d4c", "type": "new", "tokens": 5},  # vLLM's id, suffix kept
        {"request_id": "b", "type": "new", "tokens": 7},
    ]
    assert dl.phase_of(so) == "prefill"


def test_decode_only_step_is_decode():
    so = sched(cached=cached_v092(["a", "b"], [5, 7]), tokens={"a": 1, "b": 1})
    assert dl.phase_of(so, states(a=5, b=7), AscendAttentionState.DecodeOnly) == "decode"
    assert [r["type"] for r in dl.scheduled_requests(so)] == ["cached", "cached"]
    assert [r["tokens"] for r in dl.scheduled_requests(so)] == [1, 1]


def test_new_request_joining_running_decodes_is_prefill():
    so = sched(new=[new_req("c", 4)], cached=cached_v092(["a"], [9]), tokens={"c": 4, "a": 1})
    assert dl.phase_of(so, states(a=5)) == "prefill"
    assert [(r["request_id"], r["type"]) for r in dl.scheduled_requests(so)] == [
        ("c", "new"),
        ("a", "cached"),
    ]


def test_chunked_prefill_continuation_is_prefill():
    # the prompt of "a" (10 tokens) was split: 6 computed, the last 4 now
    so = sched(cached=cached_v092(["a"], [6]), tokens={"a": 4})
    assert dl.phase_of(so, states(a=10), AscendAttentionState.ChunkedPrefill) == "prefill"


def test_prefix_cache_hit_is_still_prefill():
    so = sched(new=[new_req("a", 10, computed=9)], tokens={"a": 1})
    assert dl.phase_of(so, {}, AscendAttentionState.PrefillCacheHit) == "prefill"


def test_request_resumed_after_preemption_recomputes_its_prompt():
    so = sched(cached=cached_v092(["a"], [0]), tokens={"a": 12})
    so.scheduled_cached_reqs.resumed_from_preemption = [True]
    assert dl.phase_of(so, states(a=10)) == "prefill"


def test_speculative_decoding_step_is_decode_not_prefill():
    """1 + 3 draft tokens per request: more than one token, but no prompt token. vLLM-Ascend
    sets attn_state ChunkedPrefill here for non-MTP drafts; the prompt lengths decide."""
    so = sched(
        cached=cached_v092(["a", "b"], [12, 20]),
        tokens={"a": 4, "b": 4},
        spec={"a": [1, 2, 3], "b": [4, 5, 6]},
    )
    assert dl.phase_of(so, states(a=5, b=7), AscendAttentionState.ChunkedPrefill) == "decode"
    assert [r["tokens"] for r in dl.scheduled_requests(so)] == [4, 4]


@pytest.mark.parametrize(
    ("state", "phase"),
    [
        (AscendAttentionState.DecodeOnly, "decode"),
        (AscendAttentionState.SpecDecoding, "decode"),
        (AscendAttentionState.PrefillNoCache, "prefill"),
        (AscendAttentionState.ChunkedPrefill, "prefill"),
    ],
)
def test_attention_state_decides_when_prompt_lengths_are_unknown(state, phase):
    so = sched(cached=cached_v092(["a"], [5]), tokens={"a": 1})
    assert dl.phase_of(so, None, state) == phase  # no runner.requests: the attention state decides


def test_without_any_hint_new_requests_mean_prefill():
    assert dl.phase_of(sched(cached=cached_v092(["a"], [5]), tokens={"a": 1})) == "decode"
    nameless = NS(req_id="n", prompt_token_ids=None, num_computed_tokens=0)
    assert dl.phase_of(sched(new=[nameless], tokens={"n": 3})) == "prefill"


def test_cached_requests_before_vllm_0_9_2():
    so = sched(cached=cached_pre092(["a", "b"], [5, 3]), tokens={"a": 1, "b": 2})
    assert dl.scheduled_requests(so) == [
        {"request_id": "a", "type": "cached", "tokens": 1},
        {"request_id": "b", "type": "cached", "tokens": 2},
    ]
    assert dl.phase_of(so, states(a=5, b=5)) == "prefill"  # b: 3 of 5 prompt tokens computed
    assert dl.phase_of(so, states(a=5, b=3)) == "decode"


# ---------------------------------------------------------------- attach and log_step


def test_attach_moves_the_dump_under_pid_once(tmp_path):
    debugger = FakePrecisionDebugger(str(tmp_path))
    runner = runner_with(debugger)
    logger = dl.attach(runner)
    pid_folder = tmp_path / str(os.getpid())
    assert debugger.service.config.dump_path == str(pid_folder)
    assert logger.path == str(pid_folder / dl.LOG_NAME)
    dl.attach(runner)  # a second runner in the process shares the singleton debugger
    assert debugger.service.config.dump_path == str(pid_folder)


def test_attach_without_a_debugger_does_nothing():
    runner = runner_with(None)
    assert dl.attach(runner) is None
    assert dl.log_step(runner, sched(new=[new_req("a", 3)], tokens={"a": 3})) is None


def test_one_line_per_dumped_step_in_the_documented_format(tmp_path):
    debugger = FakePrecisionDebugger(str(tmp_path))
    runner = runner_with(debugger, requests=states(a=3), attn_state=AscendAttentionState.PrefillNoCache)
    dl.attach(runner)
    dl.log_step(runner, sched(new=[new_req("a", 3)], tokens={"a": 3}))
    debugger.step()
    runner.attn_state = AscendAttentionState.DecodeOnly
    dl.log_step(runner, sched(cached=cached_v092(["a"], [3]), tokens={"a": 1}))
    first, second = read_log(tmp_path / str(os.getpid()))
    assert list(first) == DISPATCH_LOG_KEYS
    assert first["source"] == "vllm-ascend" and first["pid"] == os.getpid() and first["rank"] == 0
    assert (first["step"], first["phase"], first["total_num_scheduled_tokens"]) == (0, "prefill", 3)
    assert first["requests"] == [{"request_id": "a", "type": "new", "tokens": 3}]
    assert (second["step"], second["phase"], second["requests"][0]["type"]) == (1, "decode", "cached")
    assert second["timestamp"] >= first["timestamp"]


def test_no_line_once_the_debugger_stopped_dumping(tmp_path):
    debugger = FakePrecisionDebugger(str(tmp_path), steps=[0, 2])
    runner = runner_with(debugger)
    dl.attach(runner)
    so = sched(new=[new_req("a", 3)], tokens={"a": 3})
    written = []
    for _ in range(4):
        written.append(dl.log_step(runner, so) is not None)
        debugger.step()
    assert written == [True, False, True, False]  # only the configured steps 0 and 2 are dumped
    debugger.service.config.step = []
    assert dl.log_step(runner, so) is not None  # no step list: every step is dumped ...
    debugger.service.should_stop_service = True  # ... until msprobe stops for good
    assert dl.log_step(runner, so) is None
    assert [line["step"] for line in read_log(tmp_path / str(os.getpid()))] == [0, 2, 4]


def test_no_line_on_a_rank_msprobe_does_not_dump_or_with_dump_switched_off(tmp_path):
    debugger = FakePrecisionDebugger(str(tmp_path), ranks=[1])
    runner = runner_with(debugger)
    dl.attach(runner)
    so = sched(new=[new_req("a", 3)], tokens={"a": 3})
    assert dl.log_step(runner, so) is None
    debugger.service.current_rank = 1
    assert dl.log_step(runner, so)["rank"] == 1
    debugger.service.config.dump_enable = False
    assert dl.log_step(runner, so) is None


def test_no_line_when_0_20_finalize_has_nothing_started(tmp_path):
    runner = runner_with(FakePrecisionDebugger(str(tmp_path)), _debugger_started=False)
    dl.attach(runner)
    assert dl.log_step(runner, sched(new=[new_req("a", 3)], tokens={"a": 3})) is None
    runner._debugger_started = True
    assert dl.log_step(runner, sched(new=[new_req("a", 3)], tokens={"a": 3})) is not None


def test_acl_graph_dumper_has_no_service(tmp_path):
    dumper = FakeAclGraphDumper(str(tmp_path))
    runner = runner_with(dumper, _debugger_started=True)
    dl.attach(runner)
    assert dumper.dump_path == str(tmp_path / str(os.getpid()))
    dumper.step_id = 4
    line = dl.log_step(runner, sched(cached=cached_v092(["a"], [9]), tokens={"a": 1}))
    assert (line["step"], line["rank"], line["phase"]) == (4, 3, "decode")
    dumper.dump_enable = False
    assert dl.log_step(runner, sched(cached=cached_v092(["a"], [9]), tokens={"a": 1})) is None


def test_a_failing_write_warns_and_the_rollout_goes_on(tmp_path, capsys):
    runner = runner_with(FakePrecisionDebugger(str(tmp_path)))
    dl.attach(runner)
    (tmp_path / str(os.getpid())).write_text("a file where the folder should be")
    assert dl.log_step(runner, sched(new=[new_req("a", 3)], tokens={"a": 3})) is None
    assert "dispatch log line not written" in capsys.readouterr().err


def test_the_file_is_what_the_set_adds_and_depends_on_the_standard_library_only():
    (piece,) = [
        p for p in get_set("vllm-ascend-dispatch-log").all_pieces() if p.path.endswith("dispatch_logger.py")
    ]
    assert piece.item.content() == FILE.read_bytes()
    text = FILE.read_text()
    assert "Added to this tree by rl-msprobe" in text.split("\n", 1)[0]
    imports = {line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "functools", "json", "os", "sys", "time"}


# ---------------------------------------------------------------- per-token records
# No NPU here: NPUModelRunner's shape (a GPUModelRunner whose execute_model calls the model forward
# and the logits, `input_batch` the persistent batch) stands in, with a real torch model; where the
# marked lines land on every release is tests/patches/test_vllm_ascend_releases.py.


def records_runner(monkeypatch, tmp_path):
    """A stand-in NPUModelRunner after the set (record_step outermost on execute_model, start_records
    before the forward) on a real torch model; the helper loaded with its tree's shared recorder."""
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    from tests.support.added_files import load_with_records

    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path / "rec"))
    helper = load_with_records(
        "vllm_ascend/vllm_ascend/worker/dispatch_logger.py",
        "dispatch_logger_records",
        "vllm_ascend.worker",
        monkeypatch,
    )

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed_tokens = torch.nn.Embedding(64, 8)
            self.logits_processor = torch.nn.Linear(8, 16)

        def forward(self, input_ids, positions):
            return self.embed_tokens(input_ids)

        def compute_logits(self, hidden):
            return self.logits_processor(hidden)

    class NPUModelRunner:
        def __init__(self):
            self.model = Model()
            self.input_batch = NS(req_ids=["a-01234567", "b-01234567"], num_computed_tokens_cpu=np.array([0, 6]),
                                  num_prompt_tokens=np.array([3, 6]))  # fmt: skip

        @helper.record_step
        def execute_model(self, scheduler_output, fail=False):
            helper.start_records(self, scheduler_output)
            # the eager forward pads the batch (ACL graph sizes, DP): the model sees 6 rows
            hidden = self.model(
                input_ids=torch.tensor([7, 8, 9, 20, 0, 0]), positions=torch.tensor([0, 1, 2, 6, 0, 0])
            )
            if fail:
                raise RuntimeError("the step failed")
            return self.model.compute_logits(hidden[torch.tensor([2, 3])])

    return NPUModelRunner()


def test_records_of_a_step_on_the_npu_runner_shape(monkeypatch, tmp_path):
    runner = records_runner(monkeypatch, tmp_path)
    out = NS(num_scheduled_tokens={"a-01234567": 3, "b-01234567": 1}, total_num_scheduled_tokens=4)
    runner.execute_model(out)
    (header,) = [json.loads(p.read_text()) for p in (tmp_path / "rec").rglob("rec*.json")]
    assert (header["engine"], header["phase"], header["requests"]) == ("vllm-ascend", "mixed", ["a", "b"])
    assert header["token_rows"] == [[0, 0, 3], [1, 6, 1]] and header["sample_rows"] == [[0, 2], [1, 6]]
    kinds = {(t["key"].split(".")[1], t["label"]): t["rows"] for t in header["tensors"]}
    assert kinds == {("embed_tokens", "input.0"): "token", ("embed_tokens", "output.0"): "token",
                     ("logits_processor", "input.0"): "sample", ("logits_processor", "output.0"): "sample"}  # fmt: skip
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


def test_a_failed_step_writes_no_record_and_leaves_no_hook(monkeypatch, tmp_path):
    runner = records_runner(monkeypatch, tmp_path)
    out = NS(num_scheduled_tokens={"a-01234567": 3, "b-01234567": 1}, total_num_scheduled_tokens=4)
    with pytest.raises(RuntimeError, match="the step failed"):
        runner.execute_model(out, fail=True)
    assert not (tmp_path / "rec").exists()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


# ---------------------------------------------------------------- with the real msprobe

REAL = textwrap.dedent(
    """
    import json, os, sys
    from types import SimpleNamespace as NS
    import torch
    from msprobe.pytorch import PrecisionDebugger
    sys.path.insert(0, sys.argv[2])
    import dispatch_logger as dl

    base = sys.argv[1]
    config = os.path.join(base, "config.json")
    with open(config, "w") as f:
        json.dump({"task": "statistics", "dump_path": os.path.join(base, "dump"), "level": "L0",
                   "step": [0, 1], "statistics": {"scope": [], "list": [], "data_mode": ["all"]}}, f)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    runner = NS(debugger=PrecisionDebugger(config_path=config), model=model, requests={})
    dl.attach(runner)
    prompts = {"p0": 3, "p1": 5}
    for step in range(3):
        if step == 0:
            so = NS(scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=[1] * n, num_computed_tokens=0)
                                        for r, n in prompts.items()],
                    scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
                    num_scheduled_tokens=dict(prompts), total_num_scheduled_tokens=8)
            runner.requests = {r: NS(num_prompt_tokens=n) for r, n in prompts.items()}
        else:
            so = NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=list(prompts),
                    num_computed_tokens=[n + step - 1 for n in prompts.values()]),
                    num_scheduled_tokens={r: 1 for r in prompts}, total_num_scheduled_tokens=2)
        runner.debugger.start(model=model)
        model(torch.randn(2, 4))
        dl.log_step(runner, so)
        runner.debugger.stop()
        runner.debugger.step()
    print(os.getpid())
    """
)


def test_with_real_msprobe_dumps_and_log_share_the_pid_folder(tmp_path):
    pytest.importorskip("msprobe", reason="msprobe (mindstudio-probe) is in the [msprobe] extra")
    pytest.importorskip("torch")
    script = tmp_path / "run.py"
    script.write_text(REAL)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(FILE.parent)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = proc.stdout.strip().splitlines()[-1]
    folder = tmp_path / "dump" / pid
    steps = sorted(p.name for p in folder.glob("step*"))
    assert steps == ["step0", "step1"], sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert all(list((folder / s).glob("*/dump.json")) for s in steps)
    assert not list((tmp_path / "dump").glob("step*")), "nothing may land outside the {pid} folder"
    lines = read_log(folder)
    assert [(line["step"], line["phase"]) for line in lines] == [(0, "prefill"), (1, "decode")]
    assert [r["request_id"] for r in lines[0]["requests"]] == ["p0", "p1"]
    assert all(line["pid"] == int(pid) and line["source"] == "vllm-ascend" for line in lines)

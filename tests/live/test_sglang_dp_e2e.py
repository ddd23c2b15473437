"""Data parallel SGLang on CPU (`--dp-size 2`): each DP replica dumps under its own rank.

The plain script sets `actor_rollout_ref.rollout.data_parallel_size=2`; the engine it implies
runs SGLang's data-parallel controller with two scheduler processes (one ModelRunner each, both
with torch.distributed rank 0 of their own TP group). Without a per-replica rank both would
write `stepN/rank0`; the sglang-dump patch passes `rank_id=gpu_id`, so replica 1 writes rank1.
verl itself passes `tp_size = tp × dp` for DP attention, a GPU path; here each replica has TP 1.

Measured here (2 cores shared with four other sessions, load 11, 2026-12-01): 312 s (two
scheduler processes; the patch venv already built).
"""

from __future__ import annotations

import json

import pytest

from tests.support import live_flow, sglang_live, vllm_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
STEPS = (0, 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    python = sglang_live.python_or_skip("patch")
    model = vllm_cpu.tiny_model(python=python)
    work = tmp_path_factory.mktemp("sglang-dp")
    script = work / "run_grpo_sglang_dp.sh"
    script.write_text(sglang_live.plain_script(model, "actor_rollout_ref.rollout.data_parallel_size=2"))
    with sglang_live.session(python, script, work, "--steps", ",".join(map(str, STEPS))) as flow:
        engine = sglang_live.run_engine(python, model, flow.env, flow.server_args, work)
    return flow, engine


def test_each_dp_replica_dumps_under_its_own_rank(run):
    flow, engine = run
    assert flow.server_args.get("dp_size") == 2 and flow.sets == ["sglang-dump"], (flow.argv, flow.sets)
    assert engine.returncode == 0 and engine.result, engine.tail()
    layout = sorted(str(p.parent.relative_to(flow.dump_root)) for p in flow.dump_root.rglob("dump.json"))
    assert layout == [f"step{s}/rank{r}" for s in STEPS for r in (0, 1)], (layout, engine.tail())
    # the replicas serve different requests: their prefills embed different prompts
    firsts = [
        json.loads((flow.dump_root / "step0" / f"rank{r}" / "dump.json").read_text())["data"] for r in (0, 1)
    ]
    assert firsts[0] and firsts[1] and firsts[0] != firsts[1]


def test_dumps_check_accepts_the_two_ranks(run):
    flow, _ = run
    code, report, proc = live_flow.cli_json("dumps", "check", str(flow.dump_root))
    assert code == 0 and report["ok"], live_flow.describe(proc)

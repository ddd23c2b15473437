"""Inference mode on the live verl GRPO job (CPU), from the plain launch script the way a user
works: `env`, `detect --hint`, `prepare --mode inference --python`, `patch apply vllm-dump` (what
prepare printed) to the venv's real vLLM, run the derived script unchanged (the vLLM CPU server
rollout inside verl's agent loop), `dumps check` (detects inference), `patch revert`, and a
byte-identical venv.

Measured here (2 cores shared with other sessions, 2026-11-30): the derived job 6.5 min wall (1
step; prepare's generate config dumps vLLM step 0: one step0/rank0 dump.json, 276 KB, and the
dispatch log); the test 15 min in a run that waited ~8 min for another session's live job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import live_flow, live_job

# the full tier: the default tier's live consistency job dumps the rollout side too
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400), pytest.mark.full]
STEPS = 1  # one training step: the rollout of step 1 is what inference mode dumps


def test_inference_dumps_the_vllm_rollout_of_a_live_job(tmp_path: Path):
    job = live_job.prepare_job(tmp_path / "job", steps=STEPS)
    with live_flow.session(job, "inference", "推理采集") as flow:
        assert flow.sets == ["vllm-dump"], flow.prepared
        assert "additional_config" not in flow.script.read_text()  # upstream vLLM ignores it (device cpu)
        code, status, proc = live_flow.cli_json("patch", "status", "vllm-dump", "--python", str(job.python))
        assert code == 0 and status["sets"][0]["status"] == "applied", live_flow.describe(proc)
        result = live_job.run(job, flow.script)
        assert result.returncode == 0, result.tail()
        assert sorted(result.metrics) == list(range(1, STEPS + 1)), result.tail()
        dump_root = Path(json.loads(Path(flow.prepared["configs"]["generate"]).read_text())["dump_path"])
        code, report, proc = live_flow.cli_json("dumps", "check", str(dump_root))
    assert code == 0 and report["ok"], live_flow.describe(proc)
    assert report["mode"] == "inference", report
    dumps = sorted(dump_root.rglob("dump.json"))
    assert dumps and all(p.parent.parent.name.startswith("step") for p in dumps), dumps[:5]
    data = json.loads(dumps[0].read_text())["data"]
    assert any("layers.1" in name for name in data), list(data)[:5]
    logs = list(dump_root.rglob("dispatch_log.jsonl"))
    assert logs, f"no dispatch log under {dump_root}"
    records = [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.strip()]
    assert records, logs

"""Training mode on the live verl GRPO job (CPU), from the plain launch script the way a user
works: `env`, `detect --hint`, `prepare --mode training --python`, `patch apply` of what prepare
printed (nothing: verl's built-in precision_debugger does the dumping), run the derived script
unchanged, `dumps check`, `patch revert`, byte-identical venv.

Measured here (2 cores shared with other sessions, load 12-24, 2026-11-30): the derived job 7 min
wall (2 steps, 4.7 MB of dumps); the test ~9 min when no other live job holds the lock (29.5 min
in a run that waited 20 min for another session's job).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import live_flow, live_job

# the full tier: the default tier's live consistency job dumps the training side too
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400), pytest.mark.full]
STEPS = 2


def test_training_dumps_every_stage_that_runs_on_a_live_job(tmp_path: Path):
    job = live_job.prepare_job(tmp_path / "job", steps=STEPS)
    with live_flow.session(job, "training", "训练采集") as flow:
        assert flow.sets == [], "training mode uses verl's own precision_debugger: no patch set"
        result = live_job.run(job, flow.script)
        assert result.returncode == 0, result.tail()
        assert sorted(result.metrics) == list(range(1, STEPS + 1)), result.tail()
        save_path = Path(_override(flow.script, "global_profiler.save_path"))
        code, report, proc = live_flow.cli_json("dumps", "check", str(save_path))
        assert code == 0, live_flow.describe(proc)
    # no reference model runs in this job (no KL): the stages that run are the actor's two
    ran = {"actor_compute_log_prob", "actor_update"}
    for step in range(1, STEPS + 1):
        stages = {p.name for p in (save_path / f"step_{step}").iterdir() if p.is_dir()}
        assert stages == ran, (step, stages)
        for stage in ran:
            dumps = list((save_path / f"step_{step}" / stage).rglob("dump.json"))
            assert dumps, (step, stage)
            data = json.loads(dumps[0].read_text())["data"]
            assert any("layers.1" in name for name in data), (step, stage, list(data)[:5])
    assert report["ok"] is True, report


def _override(script: Path, key: str) -> str:
    for line in script.read_text().splitlines():
        word = line.strip().rstrip("\\").strip().strip("'")
        if word.startswith(f"{key}="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{key} not set in {script}")

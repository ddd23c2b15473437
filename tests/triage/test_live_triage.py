"""Triage on the live verl 0.9.1 GRPO job on CPU (tests/support/live_job.py), from the plain script.

One job of 4 steps: `prepare --mode triage`, the sets it names (verl-triage, verl-request-id) applied to a copy of the
release that the venv runs (first on PYTHONPATH), and a test-only rollout-side perturbation of
one layer planted from the weight sync that step 3 samples with (tests/triage/live_perturb.py).
Then `mismatch report`: its per-step mean |Δp| must equal verl's own
training/rollout_probs_diff_mean of the same steps, and its gap must jump at step 3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support import live_job
from tests.support.trees import patched_release, run_cli

pytestmark = pytest.mark.e2e

STEPS = 4
PLANT_STEP = 3


@pytest.fixture(scope="module")
def triage_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_triage")
    job = live_job.prepare_job(root / "job", steps=STEPS)
    tree = patched_release(
        "verl", "0.9.1", root / "verl-0.9.1", ["verl-triage", "verl-request-id"], with_git=False
    )
    code, out, err = run_cli(
        "prepare",
        str(job.script),
        "--mode",
        "triage",
        "--out",
        str(root / "prepared"),
        "--tree",
        str(tree),
        "--json",
    )
    assert code == 0, err + out
    plan = json.loads(out)
    hooks = root / "hooks"
    hooks.mkdir()
    shutil.copyfile(Path(__file__).with_name("live_perturb.py"), hooks / "live_perturb.py")
    plant_log = root / "plant.log"
    result = live_job.run(
        job,
        Path(plan["script"]),
        timeout_s=1500,
        pythonpath=(tree, hooks),
        worker_modules=("live_perturb",),
        RL_MSPROBE_TEST_PLANT_FROM_SYNC=str(PLANT_STEP),
        RL_MSPROBE_TEST_PLANT_LOG=str(plant_log),
    )
    assert result.returncode == 0, result.tail()
    folder = Path(plan["script"]).parent / "msprobe_tiny_grpo" / "dump" / "triage"
    code, out, err = run_cli("mismatch", "report", str(folder), "--script", str(job.script), "--json")
    assert code == 0, err + out
    return result, json.loads(out), plant_log.read_text() if plant_log.exists() else ""


def test_report_mean_dp_is_verls_rollout_probs_diff_mean(triage_run):
    result, report, _ = triage_run
    ours = {s["step"]: s for s in report["steps"]}
    assert sorted(ours) == list(range(1, STEPS + 1)), report["steps"]
    for step in range(1, STEPS + 1):
        verl = result.metrics[step]
        assert ours[step]["dp"]["mean"] == pytest.approx(
            verl["training/rollout_probs_diff_mean"], rel=1e-4, abs=1e-9
        )
        assert ours[step]["dp"]["max"] == pytest.approx(
            verl["training/rollout_probs_diff_max"], rel=1e-4, abs=1e-9
        )
        assert ours[step]["dp"]["std"] == pytest.approx(
            verl["training/rollout_probs_diff_std"], rel=1e-3, abs=1e-9
        )
    assert all(w["request_id"] for w in report["worst"]), "request ids come through verl-request-id"


def test_planted_rollout_perturbation_makes_the_gap_jump_at_its_step(triage_run):
    result, report, plant_log = triage_run
    assert "planted" in plant_log, plant_log
    means = {s["step"]: s["dp"]["mean"] for s in report["steps"]}
    before = max(means[s] for s in range(1, PLANT_STEP))
    assert all(means[s] > 10 * before for s in range(PLANT_STEP, STEPS + 1)), (means, plant_log)
    assert report["growth"]["jump_step"] == PLANT_STEP
    proposal = report["proposal"]
    assert proposal["step"] == PLANT_STEP and proposal["request"]["step"] == PLANT_STEP
    assert Path(proposal["data_file"]).is_file() and Path(proposal["script"]).is_file()
    assert proposal["commands"][0].startswith(f"rl-msprobe prepare {proposal['script']} --mode consistency")
    row = json.loads(Path(proposal["data_file"]).read_text())
    assert row["prompt"][0]["role"] == "user", row  # the dataset row came through, ready for verl's loader

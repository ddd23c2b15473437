"""The verl-triage lines on real verl 0.9.1 code (the cached verl venv, tests/support/job_venv.py).

A release patched by `rl-msprobe patch apply verl-triage` goes first on PYTHONPATH of a fresh
process (tests/patches/files/v1_scenario.py, both paths in turn, one verl import): the v1
trainer's real `_compute_old_log_prob` runs on a stand-in TransferQueue, and the legacy trainer's
DataProto runs through the marked lines read from the patched file. `mismatch report`'s numbers
must equal verl's own metrics of that batch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rl_msprobe.triage.stream import read_triage
from tests.support import verl_venv
from tests.support.trees import patched_release

pytestmark = pytest.mark.e2e
SCENARIO = Path(__file__).with_name("v1_scenario.py")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    verl_venv.venv_python_or_skip()
    return patched_release(
        "verl", "0.9.1", tmp_path_factory.mktemp("verl") / "tree", ["verl-triage"], with_git=False
    )


@pytest.fixture(scope="module")
def runs(tree, tmp_path_factory) -> Path:
    """Both paths, one process (one verl import): OUT/<path>/triage and OUT/<path>/out.json."""
    python = verl_venv.venv_python_or_skip()
    out = tmp_path_factory.mktemp("paths")
    env = {k: v for k, v in os.environ.items() if k != "RL_MSPROBE_TRIAGE"}
    proc = subprocess.run(
        [str(python), str(SCENARIO), str(out), "v1", "dataproto"],
        env={**env, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(("path", "step"), [("v1", 7), ("dataproto", 3)])
def test_report_equals_verls_own_metrics(runs, path, step):
    folder = runs / path / "triage"
    verl = json.loads((runs / path / "out.json").read_text())
    result = read_triage(folder)
    assert result.requests == 3 and result.error_count == 0 and result.bad_count == 0
    (stats,) = result.step_list()
    assert stats.step == step
    dp = stats.gaps["dp"]
    metrics = verl["metrics"]
    assert dp.count == 9  # 4 + 2 + 5 response tokens, 2 masked out (one inside, the tail is not written)
    # verl takes exp() and the differences in float32, the report in float64: float32 precision apart
    assert dp.mean() == pytest.approx(metrics["training/rollout_probs_diff_mean"], rel=1e-5)
    assert dp.peak == pytest.approx(metrics["training/rollout_probs_diff_max"], rel=1e-5)
    assert dp.std() == pytest.approx(metrics["training/rollout_probs_diff_std"], rel=1e-4)
    ids = {w.request_id for w in result.worst}
    assert ids == {"rid-a", "rid-b", "rid-c"}
    third = next(w for w in result.worst if w.request_id == "rid-c")
    assert third.prompt_ids == [31, 32, 33, 34] and third.prompt_len == 4 and third.response_len == 4

"""verl-routing on the verl releases it supports: the trainer's lines around the actor's
`self.actor.infer_batch(data)` and the rollout's first line of the worker extension's
`update_weights_from_ipc`, applied, re-applied and reverted byte-exactly; refused loudly below
(0.6.x has no engine worker; 0.7.0 has no worker extension)."""

from __future__ import annotations

import pytest

from tests.support.releases import older, supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = [pytest.mark.release, pytest.mark.timeout(1200)]

FILES = {
    "verl/utils/rl_msprobe_routing.py",
    "verl/workers/engine_workers.py",
    "verl/workers/rollout/vllm_rollout/utils.py",
}
PATCHED = supported("verl-routing")


@pytest.mark.parametrize("version", newest_in_default(PATCHED))
def test_full_cycle(version, tmp_path):
    status = full_cycle(scratch_copy("verl", version, tmp_path / f"verl-{version}"), ["verl-routing"])
    (entry,) = status["sets"]
    assert entry["status"] == "applied"
    assert {f["path"] for f in entry["files"] if f["status"] == "applied"} == FILES


@pytest.mark.parametrize("version", newest_in_default(older("verl-routing")))
def test_refused_where_a_site_is_missing(version):
    code, _, err = run_cli("patch", "diff", "verl-routing", "--tree", f"release:verl=={version}")
    assert code == 2
    assert "ActorRolloutRefWorker" in err or "vLLMColocateWorkerExtension" in err, err

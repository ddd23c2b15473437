"""verl-triage on real verl releases from the package index (cached): every trainer file the
release ships gets its line, the full cycle holds (valid diff, apply, status, compile, no-op
second apply, byte-exact revert, branch + commit), the set lives beside verl-consistency in the
same files, and a shipped trainer without the measuring statement fails loudly."""

from __future__ import annotations

import json

import pytest

from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy, snapshot

pytestmark = pytest.mark.release

RAY = "verl/trainer/ppo/ray_trainer.py"
SEPARATE = "verl/experimental/separation/ray_trainer.py"
SYNC = "verl/trainer/main_ppo_sync.py"
V1 = "verl/trainer/ppo/v1/trainer_base.py"
HELPER = "verl/utils/rl_msprobe_triage.py"
SERVER = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
# version -> the distribution's files (top k, RL_MSPROBE_TRIAGE_TOPK) and the lines each gets: the server's
# two sites (0.8.0 on), the engine's two logprobs_from_logits sites, and ray_trainer's
# _compute_old_log_prob (two calls of it in 0.7.x) on top of its triage line
TOPK = {
    "0.7.0": {ENGINE: 4, RAY: 8},
    "0.7.1": {ENGINE: 4, RAY: 8},
    "0.8.0": {ENGINE: 4, SERVER: 4, RAY: 4},
    "0.9.1": {ENGINE: 4, SERVER: 4, RAY: 4},
}

# version -> the trainer files the release ships (each gets its line)
EXPECTED = {
    "0.7.0": {RAY},
    "0.7.1": {RAY, SEPARATE},
    "0.8.0": {RAY, SEPARATE, SYNC},
    "0.9.1": {RAY, SEPARATE, V1},
}


@pytest.mark.parametrize("version", newest_in_default(sorted(EXPECTED)))
def test_triage_full_cycle_and_files(tmp_path, version):
    trainers = EXPECTED[version]
    tree = scratch_copy("verl", version, tmp_path / f"verl-{version}")
    code, out, err = run_cli("patch", "diff", "verl-triage", "--tree", str(tree), "--json", "--exit-code")
    assert code == 1, err
    doc = json.loads(out)
    touched = {f["path"]: f for f in doc["summary"]["files"]}
    topk = TOPK[version]
    assert set(touched) == {HELPER} | trainers | set(topk)
    for path in trainers | set(topk):
        # the import and the call per site
        assert touched[path]["added"] == 2 * (path in trainers) + topk.get(path, 0), (path, touched[path])
        assert touched[path]["removed"] == 0
    status = full_cycle(tree, ["verl-triage"])
    (entry,) = status["sets"]
    for f in entry["files"]:
        assert f["status"] in ("applied", "not-applicable"), f
        assert f["status"] == "applied" or f["detail"], f


def test_triage_and_consistency_share_trainer_files(tmp_path):
    """Both sets in one apply edit the same trainer files; reverting triage alone takes only its lines
    out and leaves consistency whole; reverting consistency then gives the release's bytes back."""
    plain = scratch_copy("verl", "0.9.1", tmp_path / "plain", with_git=False)
    before = snapshot(plain)
    both = ("verl-consistency", "verl-triage")
    assert run_cli("patch", "apply", *both, "--tree", str(plain))[0] == 0
    code, out, _ = run_cli("patch", "status", *both, "--tree", str(plain), "--json")
    assert code == 0 and [s["status"] for s in json.loads(out)["sets"]] == ["applied", "applied"], out
    code, _, err = run_cli("patch", "revert", "verl-triage", "--tree", str(plain))
    assert code == 0, err
    v1 = (plain / V1).read_text()
    assert "rl_msprobe_triage" not in v1 and "rl_msprobe_consistency.prompts_forward" in v1
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(plain), "--json")
    assert code == 0 and json.loads(out)["sets"][0]["status"] == "applied", out
    code, _, err = run_cli("patch", "revert", "verl-consistency", "--tree", str(plain))
    assert code == 0 and snapshot(plain) == before, err


@pytest.mark.full  # the two-set cycle: sglang's newest full cycle, each set's own cycle above
def test_triage_and_consistency_full_cycle_together(tmp_path):
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl")
    status = full_cycle(tree, ["verl-consistency", "verl-triage"])
    assert {s["name"]: s["status"] for s in status["sets"]} == {
        "verl-consistency": "applied",
        "verl-triage": "applied",
    }


@pytest.mark.parametrize(("missing", "entry"), [(SEPARATE, "one_step_off"), (RAY, "main_ppo")])
def test_a_trainer_without_the_measuring_statement_fails_loudly(tmp_path, missing, entry):
    """Loudly, and only for the jobs that run it (issue 25): `--for` that entry point refuses, writing
    nothing; without `--for` the other trainers are patched and this one is listed as not covered."""
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    path = tree / missing
    text = path.read_text()
    assert "metrics.update(calculate_debug_metrics(batch))" in text
    path.write_text(text.replace("metrics.update(calculate_debug_metrics(batch))", "pass"))
    code, _, err = run_cli("patch", "apply", "verl-triage", "--tree", str(tree), "--for", entry)
    assert code == 2 and missing in err and "calculate_debug_metrics" in err, err
    assert not (tree / "verl/utils/rl_msprobe_triage.py").exists()  # nothing half-written
    code, out, err = run_cli("patch", "apply", "verl-triage", "--tree", str(tree))
    assert code == 0 and f"NOT COVERED for {entry}: verl-triage: capability 'triage lines'" in out, out
    assert missing in out and "calculate_debug_metrics" in out and f"not covered: {entry}" in err


def test_a_tree_without_the_legacy_trainer_is_refused(tmp_path):
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    (tree / RAY).unlink()
    code, _, err = run_cli("patch", "apply", "verl-triage", "--tree", str(tree))
    assert code == 2 and RAY in err, err

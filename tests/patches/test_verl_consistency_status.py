"""`patch status verl-consistency` on a real release: every piece reported, and the set's
status is applied / absent / partial (one file reverted by hand) / conflict (an anchor
changed after apply). One command tells whether the tree that runs is fully prepared."""

from __future__ import annotations

import json

import pytest

from rl_msprobe.codemods.verl_trainer import VerlSeparateTrainer, VerlV1Trainer
from tests.support.trees import run_cli, scratch_copy

pytestmark = pytest.mark.release

V1 = "verl/trainer/ppo/v1/trainer_base.py"
SEPARATE = "verl/experimental/separation/ray_trainer.py"


def _status(tree):
    code, out, err = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    doc = json.loads(out)
    (entry,) = doc["sets"]
    return code, entry["status"], {f["codemod"]: f for f in entry["files"]}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return scratch_copy("verl", "0.9.1", tmp_path_factory.mktemp("status") / "verl", with_git=False)


def test_status_through_a_lifecycle(tree):
    code, status, pieces = _status(tree)
    assert (code, status) == (1, "absent")
    assert pieces["verl-sync-trainer"]["status"] == "not-applicable"
    assert "0.8.0" in pieces["verl-sync-trainer"]["detail"]
    assert {p["status"] for p in pieces.values()} == {"absent", "not-applicable"}

    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    code, status, pieces = _status(tree)
    assert (code, status) == (0, "applied")
    applied = {name for name, p in pieces.items() if p["status"] == "applied"}
    assert applied == {
        "verl-hooks-file",
        "verl-records-file",
        "verl-fsdp-engine",
        "verl-megatron-engine",
        "verl-consistency-file",
        "verl-ray-trainer",
        "verl-separate-trainer",
        "verl-v1-trainer",
        "verl-fully-async-trainer",
        "verl-llm-server-request-id",
        "verl-agent-loop-tq-request-id",
    }

    # one file of the set reverted by hand: the set is partial, that piece absent
    path = tree / V1
    patched = path.read_text()
    path.write_text(VerlV1Trainer().revert(patched))
    code, status, pieces = _status(tree)
    assert (code, status) == (1, "partial")
    assert pieces["verl-v1-trainer"]["status"] == "absent"
    path.write_text(patched)

    # an anchor changed after apply: conflict, naming the anchor
    path = tree / SEPARATE
    patched = path.read_text()
    bypass = (
        'bypass_recomputing_logprobs = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)'
    )
    marked = VerlSeparateTrainer().marker
    lines = patched.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if marked in line and "prompts_forward" in line)
    assert bypass in lines[at + 1]
    lines[at + 1] = lines[at + 1].replace("bypass_recomputing_logprobs =", "skip_recompute =")
    path.write_text("".join(lines))
    code, status, pieces = _status(tree)
    assert (code, status) == (1, "conflict")
    assert pieces["verl-separate-trainer"]["status"] == "conflict"
    assert "bypass_recomputing_logprobs line" in pieces["verl-separate-trainer"]["detail"]
    path.write_text(patched)

    code, status, _ = _status(tree)
    assert (code, status) == (0, "applied")
    code, out, err = run_cli("patch", "revert", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    assert _status(tree)[1] == "absent"


def test_missing_trainer_files_follow_the_tree_and_a_missing_capability_refuses(tmp_path):
    """Shape decides: an optional trainer file the tree lacks is a trainer that cannot run (skipped,
    named); RayPPOTrainer's file is required by the trim capability: without it, exit 2 naming it."""
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    (tree / "verl/experimental/fully_async_policy/fully_async_trainer.py").unlink()
    (tree / V1).unlink()
    code, out, err = run_cli(
        "patch", "diff", "verl-prompts-only", "--tree", str(tree), "--json", "--exit-code"
    )
    assert code == 1, err
    skipped = {s["codemod"]: s["detail"] for s in json.loads(out)["skipped"]}
    assert "not in this tree" in skipped["verl-fully-async-trainer"]
    assert "not in this tree" in skipped["verl-v1-trainer"]

    (tree / "verl/trainer/ppo/ray_trainer.py").unlink()
    code, out, err = run_cli("patch", "diff", "verl-prompts-only", "--tree", str(tree))
    assert code == 2 and "ray_trainer.py: missing" in err, err
    code, out, err = run_cli("patch", "status", "verl-prompts-only", "--tree", str(tree), "--json")
    (entry,) = json.loads(out)["sets"]
    assert code == 1 and entry["status"] == "conflict"
    (legacy,) = [f for f in entry["files"] if f["codemod"] == "verl-ray-trainer"]
    assert (
        legacy["status"] == "conflict" and "not in this tree" in legacy["detail"]
    )  # an absent file is never "found"

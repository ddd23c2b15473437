"""verl-consistency and its parts on every verl release rl-msprobe supports (fetched, cached).

Each version: the full cycle (valid diff, git apply / patch -p1, apply -> applied, compile,
second apply no-op, byte-exact revert, branch + commit) and the exact set of files the diff
touches: engine file(s), every trainer that runs for that version, the rollout client that
creates request ids.
"""

from __future__ import annotations

import json

import pytest

from tests.support.releases import older, supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = pytest.mark.release

ENGINE = {"verl/workers/engine/fsdp/transformer_impl.py", "verl/workers/engine/megatron/transformer_impl.py"}
HELPERS = {
    "verl/utils/rl_msprobe_hooks.py",
    "verl/utils/rl_msprobe_consistency.py",
    "verl/utils/rl_msprobe_records.py",
}
RAY = "verl/trainer/ppo/ray_trainer.py"
SEPARATE = "verl/experimental/separation/ray_trainer.py"
SYNC = "verl/trainer/main_ppo_sync.py"
V1 = "verl/trainer/ppo/v1/trainer_base.py"
FULLY_ASYNC_TRAINER = "verl/experimental/fully_async_policy/fully_async_trainer.py"
AGENT_LOOP = "verl/experimental/agent_loop/agent_loop.py"
LLM_SERVER = "verl/workers/rollout/llm_server.py"
FULLY_ASYNC_ROLLOUTER = "verl/experimental/fully_async_policy/fully_async_rollouter.py"
AGENT_LOOP_TQ = "verl/trainer/ppo/v1/agent_loop_tq.py"

# version -> (trainer files, request-id files), for every release of the parts' range. verl-consistency
# refuses 0.6.x (its actor never runs the engine: nothing would be dumped); its two parts apply there
# and are checked on their own.
EXPECTED = {
    "0.6.0": ({RAY}, {AGENT_LOOP}),
    "0.6.1": ({RAY}, {AGENT_LOOP}),
    "0.7.0": ({RAY}, {AGENT_LOOP}),
    "0.7.1": ({RAY, SEPARATE}, {AGENT_LOOP}),  # the 0.7.1 wheel ships no fully_async_trainer.py
    "0.8.0": ({RAY, SEPARATE, SYNC, FULLY_ASYNC_TRAINER}, {LLM_SERVER, FULLY_ASYNC_ROLLOUTER}),
    "0.9.0": ({RAY, SEPARATE, V1, FULLY_ASYNC_TRAINER}, {LLM_SERVER, AGENT_LOOP_TQ}),
    "0.9.1": ({RAY, SEPARATE, V1, FULLY_ASYNC_TRAINER}, {LLM_SERVER, AGENT_LOOP_TQ}),
}
VERSIONS = supported("verl-consistency")  # a release without a row above fails as a KeyError


def _diff_json(tree, *sets):
    code, out, err = run_cli("patch", "diff", *sets, "--tree", str(tree), "--json", "--exit-code")
    assert code == 1, err
    return json.loads(out)


@pytest.mark.parametrize("version", newest_in_default(VERSIONS))
def test_consistency_full_cycle_and_files(tmp_path, version):
    trainers, rollout = EXPECTED[version]
    tree = scratch_copy("verl", version, tmp_path / f"verl-{version}")
    doc = _diff_json(tree, "verl-consistency")
    touched = {f["path"] for f in doc["summary"]["files"]}
    assert touched == ENGINE | HELPERS | trainers | rollout
    # each upstream file gets only added lines, one import + its call lines
    for f in doc["summary"]["files"]:
        assert f["removed"] == 0
    skipped = {s["path"]: s["detail"] for s in doc["skipped"]}
    assert not (set(skipped) & touched)
    status = full_cycle(tree, ["verl-consistency"])
    (entry,) = status["sets"]
    applied = {f["path"] for f in entry["files"] if f["status"] == "applied"}
    assert applied == touched
    for f in entry["files"]:
        assert f["status"] in ("applied", "not-applicable"), f
        if f["status"] == "not-applicable":
            assert f["detail"], f  # says why


PARTS = [
    ("verl-prompts-only", "0.6.0", True),  # the recompute-call anchor
    ("verl-request-id", "0.6.1", True),  # agent loop on AgentLoopWorkerBase, the caller's id to the server
    ("verl-prompts-only", "0.8.0", True),  # ray + separation + main_ppo_sync + fully-async trainers
    ("verl-request-id", "0.7.0", True),  # agent loop, TokenOutput without extra_fields
    ("verl-request-id", "0.9.1", False),  # llm_server with the fully-async client, v1 agent loop
]


@pytest.mark.parametrize("version", newest_in_default(older("verl-consistency")))
def test_consistency_refuses_06_with_the_reason(version):
    code, out, err = run_cli("patch", "diff", "verl-consistency", "--tree", f"release:verl=={version}")
    assert code == 2 and out == ""
    assert f"verl {version} tree does not have" in err and "engine runs the actor" in err
    assert "legacy workers" in err and "0.7.0" in err


@pytest.mark.parametrize(("name", "version", "cycle"), newest_in_default(PARTS, version=lambda p: p[1]))
def test_part_sets(tmp_path, name, version, cycle):
    """Each part alone touches only its own files; two of them also run the whole cycle alone."""
    trainers, rollout = EXPECTED[version]
    tree = scratch_copy("verl", version, tmp_path / f"verl-{version}", with_git=cycle)
    touched = {f["path"] for f in _diff_json(tree, name)["summary"]["files"]}
    wanted = trainers if name == "verl-prompts-only" else rollout
    assert touched == wanted | {"verl/utils/rl_msprobe_consistency.py"}
    if cycle:
        full_cycle(tree, [name])


def test_trim_line_sits_before_the_recompute_switch(tmp_path):
    """The inserted line precedes the bypass switch in the method that recomputes, not the advantage step."""
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    doc = _diff_json(tree, "verl-prompts-only")
    for rel in (SEPARATE, V1, RAY):
        hunks = doc["diff"].split(f"diff --git a/{rel} ")[1].split("diff --git")[0]
        added = [line for line in hunks.splitlines() if line.startswith("+") and not line.startswith("+++")]
        assert len(added) == 2, added  # the import and one trim call
        assert "bypass_recomputing_logprobs =" in hunks.split("prompts_forward")[1].splitlines()[1]

"""`prepare --mode triage` / `check --mode triage`: what the derived script carries (no msprobe)."""

from __future__ import annotations

import json

from tests.support.trees import run_cli

SCRIPT = """#!/bin/bash
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_batch_size=1024 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.n=5 \\
    trainer.n_gpus_per_node=8 $@
"""


def test_prepare_triage_sets_log_probs_env_and_the_patch_set(tmp_path):
    script = tmp_path / "run_grpo.sh"
    script.write_text(SCRIPT)
    code, out, err = run_cli("prepare", str(script), "--mode", "triage", "--python", "python3", "--json")
    assert code == 0, err + out
    plan = json.loads(out)
    assert plan["patch_sets"] == ["verl-triage", "verl-request-id", "verl-routing"] and plan["configs"] == {}
    assert plan["patch_commands"][0].startswith(
        "rl-msprobe patch apply verl-triage verl-request-id verl-routing"
    )
    derived = (tmp_path / "run_triage_grpo.sh").read_text()
    assert "actor_rollout_ref.rollout.calculate_log_probs=True" in derived
    folder = str(tmp_path / "msprobe_grpo" / "dump" / "triage")
    assert f"export RL_MSPROBE_TRIAGE={folder}" in derived and "export RL_MSPROBE_REQUEST_ID=1" in derived
    assert f"++ray_kwargs.ray_init.runtime_env.env_vars.RL_MSPROBE_TRIAGE={folder}" in derived
    assert "data.train_batch_size=1024" in derived  # no batch constraint
    # the distribution per position: the rollout's top 20, where the trainer and the rollout workers see it
    assert "export RL_MSPROBE_TRIAGE_TOPK=20" in derived
    assert "'++ray_kwargs.ray_init.runtime_env.env_vars.RL_MSPROBE_TRIAGE_TOPK=\"20\"'" in derived
    # the report command to run next carries the script and the interpreter, for its own next command
    assert any(f"mismatch report {folder} --script {script} --python python3" in n for n in plan["notes"])
    code, _, _ = run_cli("check", str(tmp_path / "run_triage_grpo.sh"), "--mode", "triage")
    assert code == 0
    code, out, _ = run_cli("check", str(script), "--mode", "triage", "--json")
    keys = {v["key"] for v in json.loads(out)["violations"]}
    assert code == 1 and {"actor_rollout_ref.rollout.calculate_log_probs", "RL_MSPROBE_TRIAGE"} <= keys


def test_bypass_mode_would_hide_the_gap(tmp_path):
    script = tmp_path / "run_bypass.sh"
    script.write_text(SCRIPT.replace("$@", "algorithm.rollout_correction.bypass_mode=True $@"))
    code, out, _ = run_cli("check", str(script), "--mode", "triage", "--json")
    assert code == 1 and "algorithm.rollout_correction.bypass_mode" in {
        v["key"] for v in json.loads(out)["violations"]
    }
    code, out, _ = run_cli("prepare", str(script), "--mode", "triage", "--json")
    assert code == 0 and "bypass_mode=False" in (tmp_path / "run_triage_bypass.sh").read_text()


def test_top_k_is_a_flag_and_zero_turns_it_off(tmp_path):
    script = tmp_path / "run_grpo.sh"
    script.write_text(SCRIPT)
    for k, expected in (("5", "export RL_MSPROBE_TRIAGE_TOPK=5"), ("0", None)):
        out_dir = tmp_path / f"k{k}"
        code, out, err = run_cli(
            "prepare", str(script), "--mode", "triage", "--top-k", k, "--out", str(out_dir)
        )
        assert code == 0, err + out
        derived = next(out_dir.glob("run_triage_*.sh")).read_text()
        if expected:
            assert expected in derived
        else:
            assert "RL_MSPROBE_TRIAGE_TOPK" not in derived

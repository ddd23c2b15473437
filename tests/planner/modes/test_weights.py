"""prepare / check / detect for weight parity, on the launch-script fixtures (no job runs)."""

from __future__ import annotations

import json
import shutil

from tests.support.codemod_cases import FIXTURES
from tests.support.trees import run_cli

LAUNCH = FIXTURES.parent / "launch"
VLLM = LAUNCH / "run_qwen2_7b_grpo_fsdp_vllm.sh"
SGLANG = LAUNCH / "run_qwen3_8b_arrays_fsdp_sglang.sh"
VAR = "RL_MSPROBE_WEIGHTS_DIR"


def _prepare(tmp_path, script, *args):
    local = tmp_path / script.name
    shutil.copyfile(script, local)
    code, out, err = run_cli("prepare", str(local), *args, "--dump-dir", str(tmp_path / "dump"), "--json")
    return code, json.loads(out), local


def test_mode_weights_only_adds_the_folder_and_the_set(tmp_path):
    code, doc, local = _prepare(tmp_path, VLLM, "--mode", "weights")
    assert code == 0 and doc["written"], doc
    assert doc["patch_sets"] == ["verl-weights"] and doc["configs"] == {}
    folder = str(tmp_path / "dump" / "weights")
    assert [c["key"] for c in doc["changes"]] == [VAR] and doc["changes"][0]["required"] == folder
    derived = (tmp_path / "run_weights_qwen2_7b_grpo_fsdp_vllm.sh").read_text()
    assert f"export {VAR}={folder}" in derived
    assert f"ray_kwargs.ray_init.runtime_env.env_vars.{VAR}" in derived  # the Ray workers get it too
    code, out, _ = run_cli("check", doc["script"], "--json")
    check = json.loads(out)
    assert code == 0 and check["mode"] == "weights" and check["ok"], check
    code, out, _ = run_cli("check", str(local), "--mode", "weights", "--json")
    assert code == 1 and [v["key"] for v in json.loads(out)["violations"]] == [VAR]


def test_weights_flag_adds_to_another_mode(tmp_path):
    code, doc, _ = _prepare(tmp_path, VLLM, "--mode", "consistency", "--weights")
    assert code == 0, doc
    assert "verl-weights" in doc["patch_sets"] and "verl-consistency" in doc["patch_sets"]
    assert VAR in {c["key"] for c in doc["changes"]}
    (tmp_path / "plain").mkdir()
    code, plain, _ = _prepare(tmp_path / "plain", VLLM, "--mode", "consistency")
    assert "verl-weights" not in plain["patch_sets"]


def test_sglang_rollout_gets_the_sglang_side_too(tmp_path):
    """verl-weights for the actor (verl tree), sglang-weights for the engine (SGLang tree): one
    patch command per tree, and the folder reaches the Ray workers SGLang's schedulers inherit."""
    code, doc, _ = _prepare(tmp_path, SGLANG, "--mode", "weights")
    assert code == 0 and doc["written"], doc
    assert doc["patch_sets"] == ["verl-weights", "sglang-weights"]
    commands = doc["patch_commands"]
    assert len(commands) == 2, commands
    assert any("verl-weights" in c and "sglang-weights" not in c for c in commands), commands
    assert any("sglang-weights" in c and "verl-weights" not in c for c in commands), commands
    derived = (tmp_path / "run_weights_qwen3_8b_arrays_fsdp_sglang.sh").read_text()
    assert f"ray_kwargs.ray_init.runtime_env.env_vars.{VAR}" in derived


def test_detect_by_hint():
    code, out, _ = run_cli("detect", str(VLLM), "--hint", "rollout 和 actor 的权重同步对不对", "--json")
    assert code == 0 and json.loads(out)["mode"] == "weights"

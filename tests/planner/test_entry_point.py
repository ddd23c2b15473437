"""`prepare` and `check` name the entry point the launch script starts, so the patch command they print
asks only for what that job runs (`patch apply ... --for main_ppo`); a recipe's own main gets none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_msprobe import planner
from tests.support.trees import run_cli

from .conftest import CORPUS

SCRIPTS = Path(__file__).resolve().parents[1] / "data" / "launch_scripts"
FULLY_ASYNC = SCRIPTS / "verl/examples/mtp_trainer/run_mimo_7b_mtp_fully_async_megatron_multinode.sh"
RECIPE_MAIN = SCRIPTS / "recipe/reward_queue/train_async.sh"  # python -m recipe.reward_queue.main
MAIN_PPO = CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh"
# keys of verl's main branch these upstream scripts set, which verl 0.9.1 (the release the keys are
# checked against without --tree) refuses at start: taken out, so the scripts compose there
NEWER_KEYS = ("actor_rollout_ref.actor.megatron.grad_offload=", "rollout.test_freq=")


def on_release(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.strip().startswith(NEWER_KEYS))


@pytest.mark.parametrize(
    ("script", "entry"),
    [(MAIN_PPO, "main_ppo"), (FULLY_ASYNC, "fully_async"), (RECIPE_MAIN, None)],
)
def test_check_names_the_entry_point_in_the_patch_command(script: Path, entry: str | None) -> None:
    report = planner.check(on_release(script.read_text()), str(script), mode="consistency", backend="vllm")
    assert report.entry_point == entry
    (verl,) = [c for c in report.patch_commands if "verl-consistency" in c]
    assert verl.endswith(f" --for {entry}") if entry else "--for" not in verl
    vllm = [c for c in report.patch_commands if "vllm-dump" in c]
    assert all("--for" not in c for c in vllm)  # vLLM has a single path
    explained = [n for n in report.notes if "not an entry point whose trainer rl-msprobe knows" in n]
    assert bool(explained) == (entry is None)


def test_prepare_prints_the_apply_command_with_the_entry_point(tmp_path: Path) -> None:
    script = tmp_path / "run_job.sh"
    script.write_text(on_release(FULLY_ASYNC.read_text()))
    code, out, err = run_cli("prepare", str(script), "--mode", "consistency", "--json")
    doc = json.loads(out)
    assert doc["entry_point"] == "fully_async", err
    assert (
        'rl-msprobe patch apply verl-consistency --tree "$VERL_TREE" --for fully_async'
        in (doc["patch_commands"])
    )
    code, out, err = run_cli("check", str(script), "--mode", "consistency")
    assert "patches this job needs:" in out and "--for fully_async" in out
    assert "  - set VERL_TREE to the verl tree that actually runs" in out

"""Mode, rollout and backend detection: the specification's signal table, hints winning over scripts."""

from __future__ import annotations

import pytest

from rl_msprobe.launch.detect import detect
from rl_msprobe.launch.script import parse_script

PLAIN = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm\n"


@pytest.mark.parametrize(
    ("hint", "mode"),
    [
        ("帮我做推理采集", "inference"),
        ("rollout dump please", "inference"),
        ("generate dump of step 1", "inference"),
        ("做训推一致性对比", "consistency"),
        ("prefill 对齐", "consistency"),
        ("训练采集", "training"),
        ("use global_profiler", "training"),
        ("only actor_update", "training"),
        ("precision_debugger stages", "training"),
        ("no idea", "unknown"),
    ],
)
def test_hint_signals(hint: str, mode: str) -> None:
    assert detect(parse_script(PLAIN), hint).mode == mode


@pytest.mark.parametrize(
    ("line", "mode"),
    [
        ("global_profiler.tool=precision_debugger", "training"),
        ("++global_profiler.global_tool_config.precision_debugger.stages=[actor_update]", "training"),
        (
            "++actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config_path=/a.json",
            "inference",
        ),
        ("++actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config=/a.json", "inference"),
    ],
)
def test_script_signals(line: str, mode: str) -> None:
    assert detect(parse_script(f"python3 -m verl.trainer.main_ppo {line}\n")).mode == mode


def test_dump_on_and_prompts_only_mean_consistency() -> None:
    text = "export DUMP_ON=1 PROMPTS_ONLY=1\npython3 -m verl.trainer.main_ppo a=1\n"
    assert detect(parse_script(text)).mode == "consistency"
    assert detect(parse_script("export DUMP_ON=1\npython3 -m verl.trainer.main_ppo a=1\n")).mode == "unknown"


def test_signals_in_comments_do_not_count() -> None:
    text = "# global_profiler.tool=precision_debugger\npython3 -m verl.trainer.main_ppo a=1\n"
    assert detect(parse_script(text)).mode == "unknown"


def test_hint_wins_and_reasons_say_so() -> None:
    script = parse_script("python3 -m verl.trainer.main_ppo global_profiler.tool=precision_debugger\n")
    det = detect(script, "推理采集")
    assert det.mode == "inference"
    assert any("the hint wins" in r for r in det.reasons)


def test_missing_rollout_name_is_explained() -> None:
    det = detect(parse_script("python3 -m verl.trainer.main_ppo a=1\n"))
    assert det.rollout == "unknown"
    assert any("would not start" in r for r in det.reasons)


def test_runtime_rollout_name() -> None:
    det = detect(parse_script("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=$ENGINE\n"))
    assert det.rollout == "unknown" and any("run time" in r for r in det.reasons)


@pytest.mark.parametrize(
    ("args", "backend"),
    [
        ("model_engine=megatron", "megatron"),
        ("--config-name=ppo_megatron_trainer.yaml", "megatron"),
        ("--config-name ppo_megatron_trainer", "megatron"),
        ("actor_rollout_ref.actor.strategy=fsdp2", "fsdp"),
        ("a=1", "fsdp"),
        ("model_engine=veomni", "unknown"),
    ],
)
def test_train_backend(args: str, backend: str) -> None:
    assert detect(parse_script(f"python3 -m verl.trainer.main_ppo {args}\n")).train_backend == backend


@pytest.mark.parametrize(
    ("value", "device"), [("cpu", "cpu"), ("npu", "npu"), ("cuda", "gpu"), ("CPU", "cpu")]
)
def test_trainer_device_names_the_device(value: str, device: str) -> None:
    det = detect(parse_script(PLAIN.rstrip("\n") + f" trainer.device={value}\n"))
    assert det.device == device
    assert f"device {device}: trainer.device={value}" in det.reasons

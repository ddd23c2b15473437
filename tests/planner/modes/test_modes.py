"""Each mode's rules as they depend on versions, backends and options."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe import planner
from rl_msprobe.cli import main
from rl_msprobe.errors import UserError
from rl_msprobe.launch.overrides import Overrides, parse_override
from rl_msprobe.launch.script import parse_script
from rl_msprobe.planner.modes.base import Options
from tests.planner.conftest import CORPUS
from tests.support.codemod_cases import FIXTURES


def plan(name: str, mode: str, tmp_path: Path, **kw: object) -> planner.Plan:
    """`kw`: PlanRequest fields and Options fields (stages=, backend=, ...), as prepare's flags mix them."""
    text = (CORPUS / name).read_text()
    choices = {f.name for f in dataclasses.fields(Options)}
    options = Options(**{k: v for k, v in kw.items() if k in choices})  # type: ignore[arg-type]
    rest = {k: v for k, v in kw.items() if k not in choices}
    request = planner.PlanRequest(
        text, str(tmp_path / name), mode=mode, out_dir=str(tmp_path), options=options, **rest
    )  # type: ignore[arg-type]
    return planner.plan(request)


def derived_overrides(p: planner.Plan) -> Overrides:
    script = parse_script(p.derived_text)
    assert script.command is not None
    return Overrides(script.command.args)


def value(p: planner.Plan, key: str) -> object:
    found = derived_overrides(p).get(key)
    return None if found is None else found.value


def test_consistency_refuses_verl_0_6(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, versions={"verl": "0.6.1"})
    assert p.refused and "consistency.verl_version" in [v.rule for v in p.violations]
    assert "legacy workers" in " ".join(v.fix + v.required for v in p.violations)
    ok = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, versions={"verl": "0.7.0"})
    assert "consistency.verl_version" not in [v.rule for v in ok.violations]


def test_training_refuses_verl_before_0_8(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "training", tmp_path, versions={"verl": "0.7.1"})
    assert p.refused and [v.rule for v in p.violations] == ["training.verl_version"]
    assert "0.8.0" in p.violations[0].fix


def test_training_megatron_needs_0_9(tmp_path: Path) -> None:
    p = plan("run_deepseek_megatron_vllm.sh", "training", tmp_path, versions={"verl": "0.8.0"})
    assert p.refused and [v.rule for v in p.violations] == ["training.megatron_version"]
    assert not plan("run_deepseek_megatron_vllm.sh", "training", tmp_path, versions={"verl": "0.9.0"}).refused


def test_training_settings_and_stage_subset(tmp_path: Path) -> None:
    p = plan(
        "run_qwen2_7b_grpo_fsdp_vllm.sh",
        "training",
        tmp_path,
        stages=["actor_compute_log_prob", "actor_update"],
    )
    assert value(p, "global_profiler.tool") == "precision_debugger"
    assert value(p, "global_profiler.steps") == [1, 2]
    assert value(p, "global_profiler.global_tool_config.precision_debugger.stages") == [
        "actor_compute_log_prob",
        "actor_update",
    ]
    assert value(p, "actor_rollout_ref.actor.profiler.enable") is True
    assert value(p, "actor_rollout_ref.ref.profiler.enable") is None  # ref stage not collected
    assert str(value(p, "global_profiler.save_path")).startswith(str(tmp_path))
    assert "dump_path" not in p.configs["training"][1]
    full = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "training", tmp_path)
    assert value(full, "actor_rollout_ref.ref.profiler.enable") is True


def test_consistency_on_verl_0_7_enables_the_engine_workers(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, versions={"verl": "0.7.1"})
    assert value(p, "trainer.use_legacy_worker_impl") == "disable"
    assert (
        value(
            plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path), "trainer.use_legacy_worker_impl"
        )
        is None
    )
    assert plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, versions={"verl": "0.5.0"}).refused


def test_consistency_fsdp_alignment_and_batches(tmp_path: Path) -> None:
    p = plan("run_qwen3_8b_arrays_fsdp_sglang.sh", "consistency", tmp_path, batch_one=True)
    # NGPUS_PER_NODE=${NGPUS_PER_NODE:-4} x NNODES=${NNODES:-1}: 4 devices, SP forced to 1
    assert value(p, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 4
    assert value(p, "actor_rollout_ref.rollout.data_parallel_size") == 1
    assert value(p, "actor_rollout_ref.rollout.n") == 4
    for key in (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    ):
        assert value(p, key) == 1
    for key in (
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ):
        assert value(p, key) == 1
    assert value(p, "actor_rollout_ref.actor.use_dynamic_bsz") is False
    assert value(p, "trainer.val_before_train") is False
    # every dumped prefill is one request, run in full (issue 20: n samples share a step otherwise)
    assert value(p, "actor_rollout_ref.rollout.max_num_seqs") == 1
    assert value(p, "actor_rollout_ref.rollout.enable_prefix_caching") is False
    assert any("NNODES" in n for n in p.notes), "defaults taken from ${X:-d} are reported"


def test_consistency_megatron_alignment(tmp_path: Path) -> None:
    p = plan("run_deepseek_megatron_vllm.sh", "consistency", tmp_path, batch_one=True)
    assert value(p, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 4
    assert value(p, "actor_rollout_ref.rollout.pipeline_model_parallel_size") == 2
    assert value(p, "actor_rollout_ref.rollout.expert_parallel_size") == 4
    assert value(p, "actor_rollout_ref.rollout.n") == 2  # 16 devices / (TP 4 x PP 2)


def test_consistency_fully_async(tmp_path: Path) -> None:
    p = plan("run_fully_async_qwen2_5_vllm.sh", "consistency", tmp_path, batch_one=True)
    assert value(p, "data.train_batch_size") == 0
    assert value(p, "async_training.require_batches") == 1
    assert value(p, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 4  # rollout.n_gpus_per_node
    assert value(p, "actor_rollout_ref.rollout.n") == 4  # trainer devices


def test_consistency_env_reaches_workers_as_strings(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, batch_one=True)
    env = dict((n, v) for n, v, _ in p.env)
    assert env["DUMP_ON"] == "1" and env["PROMPTS_ONLY"] == "1" and env["DUMP_PHASE"] == "log_prob"
    assert env["MSPROBE_ACTOR_CONFIG"] == p.configs["actor"][0]
    for name, val in env.items():
        assert f"export {name}=" in p.derived_text
        assert value(p, f"ray_kwargs.ray_init.runtime_env.env_vars.{name}") == val
    assert p.patch_sets[0] == "verl-consistency"


def test_vllm_gpu_gets_the_patch_and_no_runner_setting(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "inference", tmp_path)
    assert p.patch_sets == ["vllm-dump"]
    assert "VLLM_USE_V2_MODEL_RUNNER" not in p.derived_text  # the patch dumps whichever runner runs
    assert any("V1, V2 or both" in n for n in p.notes)
    assert value(p, "actor_rollout_ref.rollout.enforce_eager") is True
    assert (
        value(p, "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config_path")
        == p.configs["generate"][0]
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_upstream_vllm_gets_no_dump_config_path_it_would_ignore(tmp_path: Path, device: str) -> None:
    text = (
        (CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_text().replace(" $@", f" trainer.device={device} $@")
    )
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run.sh"), mode="inference", out_dir=str(tmp_path))
    )
    assert p.patch_sets == ["vllm-dump"] and not p.violations
    assert f"export MSPROBE_ROLLOUT_CONFIG={p.configs['generate'][0]}" in p.derived_text
    assert "additional_config" not in "\n".join(
        line for line in p.derived_text.splitlines() if not line.lstrip().startswith("#")
    )
    assert any("dump_config_path is not set" in note for note in p.notes)


def test_vllm_ascend_needs_no_patch(tmp_path: Path) -> None:
    p = plan("run_infer_dump_vllm_ascend.sh", "inference", tmp_path)
    assert p.patch_sets == [] and not p.violations
    assert plan(
        "run_infer_dump_vllm_ascend.sh", "inference", tmp_path, versions={"vllm-ascend": "0.11.0"}
    ).refused
    old = plan("run_infer_dump_vllm_ascend.sh", "inference", tmp_path, versions={"vllm-ascend": "0.12.0rc1"})
    assert (
        value(old, "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config")
        == old.configs["generate"][0]
    )


def test_sglang_native_and_patched(tmp_path: Path) -> None:
    key = "actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config"
    new = plan("run_qwen3_8b_arrays_fsdp_sglang.sh", "inference", tmp_path)
    assert value(new, key) == new.configs["generate"][0] and new.patch_sets == []
    assert any("assuming the newest" in n for n in new.notes)
    old = plan("run_infer_dump_sglang_eager_off.sh", "inference", tmp_path, versions={"sglang": "0.5.9"})
    assert old.patch_sets == ["sglang-dump"]
    assert value(old, key) is None  # the native key would be a TypeError there: removed
    assert ("MSPROBE_ROLLOUT_CONFIG", old.configs["generate"][0]) in [(n, v) for n, v, _ in old.env]


def test_sglang_pd_disaggregation(tmp_path: Path) -> None:
    native = plan("run_sglang_pd_disagg.sh", "inference", tmp_path)
    assert ("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0") in [(n, v) for n, v, _ in native.env]
    old = plan("run_sglang_pd_disagg.sh", "inference", tmp_path, versions={"sglang": "0.5.3"})
    assert sorted(old.configs) == ["decode", "prefill"]
    env = {n: v for n, v, _ in old.env}
    assert env["MSPROBE_PREFILL_CONFIG"] == old.configs["prefill"][0]
    assert env["MSPROBE_DECODE_CONFIG"] == old.configs["decode"][0]
    assert old.configs["prefill"][1]["dump_path"] != old.configs["decode"][1]["dump_path"]


def test_unknown_rollout_is_refused_for_inference(tmp_path: Path) -> None:
    p = plan("run_no_rollout_name.sh", "inference", tmp_path)
    assert p.refused and p.violations[0].key == "actor_rollout_ref.rollout.name"
    assert not plan("run_no_rollout_name.sh", "inference", tmp_path, backend="sglang").refused


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_prepare_with_trees_names_them_in_the_patch_command(tmp_path: Path) -> None:
    tree = tmp_path / "sgl"
    (tree / "sglang").mkdir(parents=True)
    (tree / "sglang" / "__init__.py").write_text("")
    (tree / "sglang" / "version.py").write_text('__version__ = "0.5.9"\n')
    script = tmp_path / "run_x.sh"
    script.write_bytes((CORPUS / "run_qwen3_8b_arrays_fsdp_sglang.sh").read_bytes())
    code, out, _ = cli("prepare", str(script), "--mode", "inference", "--tree", str(tree), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["versions"] == {"sglang": "0.5.9"}
    assert doc["patch_commands"] == [f"rl-msprobe patch apply sglang-dump --tree {tree}"]


def test_prepare_options_and_bad_input(tmp_path: Path) -> None:
    script = tmp_path / "run_x.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    code, out, _ = cli(
        "prepare",
        str(script),
        "--mode",
        "consistency",
        "--batch-one",
        "--level",
        "L0",
        "--steps",
        "0,1",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0
    for path in doc["configs"].values():
        cfg = json.loads(Path(path).read_text())
        assert cfg["level"] == "L0" and cfg["step"] == [0, 1]
    assert cli("prepare", str(script), "--mode", "training", "--stages", "actor_update,bogus")[0] == 2
    assert cli("prepare", str(script), "--mode", "inference", "--stages", "actor_update")[0] == 2
    assert cli("prepare", str(script), "--mode", "inference", "--dump-dir", "/tmp/has space")[0] == 2
    assert cli("prepare", str(script), "--mode", "inference", "--steps", "a,b")[0] == 2
    assert cli("prepare", str(script))[0] == 2  # mode undecidable: ask
    assert cli("prepare", str(tmp_path / "missing.sh"), "--mode", "training")[0] == 2
    code, _, err = cli("prepare", str(script), "--hint", "推理采集")
    assert code == 0


def test_prepare_never_overwrites_the_original(tmp_path: Path) -> None:
    script = tmp_path / "run_profiler_x.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    before = script.read_bytes()
    code, _, err = cli("prepare", str(script), "--mode", "training")
    # run_profiler_x.sh -> run_profiler_profiler_x.sh: a different file
    assert code == 0 and script.read_bytes() == before


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    script = tmp_path / "bad.sh"
    script.write_text('python3 -m verl.trainer.main_ppo \\\n  a="open\n')
    code, _, err = cli("check", str(script), "--mode", "training")
    assert code == 2 and "line 2" in err


def test_check_reads_the_msprobe_configs_the_script_points_at(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"task": "statistics", "dump_path": "/x", "level": "mix", "rank": [], "step": []})
    )
    script = tmp_path / "run_t.sh"
    script.write_text(
        (CORPUS / "run_training_dump_handwritten.sh")
        .read_text()
        .replace("/work/msprobe/config.json", str(config))
    )
    code, out, _ = cli("check", str(script), "--mode", "training", "--json")
    doc = json.loads(out)
    assert code == 1 and [v["rule"] for v in doc["violations"]] == ["msprobe_config.training"]
    assert "must not set dump_path" in doc["violations"][0]["fix"]
    config.write_text(json.dumps({"task": "statistics", "level": "mix", "rank": [], "step": []}))
    assert cli("check", str(script), "--mode", "training")[0] == 0


def test_ray_job_submission_is_flagged(tmp_path: Path) -> None:
    report = planner.check(
        (CORPUS / "run_ray_job_submit_runtime.sh").read_text(),
        str(tmp_path / "x.sh"),
        mode="consistency",
        backend="vllm",
    )
    assert any("ray job submit" in u for u in report.result.unverifiable)
    assert any("actor_rollout_ref.rollout.name" not in u for u in report.result.unverifiable)


def test_sweep_values_are_violations(tmp_path: Path) -> None:
    text = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm trainer.logger=console,wandb\n"
    )
    report = planner.check(text, str(tmp_path / "x.sh"), mode="training")
    sweep = [v for v in report.result.violations if v.rule == "hydra.sweep"]
    assert sweep and "trainer.logger=[a,b]" in sweep[0].fix


def test_training_save_path_must_suit_msprobe(tmp_path: Path) -> None:
    text = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm global_profiler.save_path='/data/my dumps'\n"
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run_x.sh"), mode="training", out_dir=str(tmp_path))
    )
    assert not p.violations and value(p, "global_profiler.save_path") == str(
        tmp_path / "msprobe_x" / "dump" / "training"
    )


def test_unknown_training_backend_needs_to_be_named(tmp_path: Path) -> None:
    text = "python3 -m verl.trainer.main_ppo --config-name my_lab_cfg actor_rollout_ref.rollout.name=vllm\n"
    path = str(tmp_path / "run_x.sh")
    p = planner.plan(planner.PlanRequest(text, path, mode="consistency", out_dir=str(tmp_path)))
    assert p.refused and p.violations[0].rule == "consistency.train_backend"
    p = planner.plan(
        planner.PlanRequest(
            text, path, mode="consistency", out_dir=str(tmp_path), options=Options(train_backend="megatron")
        )
    )
    assert not p.refused and not p.violations
    assert value(p, "actor_rollout_ref.rollout.tensor_model_parallel_size") is None  # the job's TP stays
    p = planner.plan(
        planner.PlanRequest(
            text,
            path,
            mode="consistency",
            out_dir=str(tmp_path),
            options=Options(train_backend="megatron", batch_one=True),
        )
    )
    assert not p.refused and not p.violations
    assert value(p, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 1  # the actor's default TP


def test_training_steps_must_be_reached_and_stages_must_fire(tmp_path: Path) -> None:
    base = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm "
    report = planner.check(
        base + "trainer.total_training_steps=1 'global_profiler.steps=[1,2]'\n",
        str(tmp_path / "x.sh"),
        mode="training",
    )
    assert "training.steps_in_range" in {v.rule for v in report.result.violations}
    stages = "'++global_profiler.global_tool_config.precision_debugger.stages=[actor_compute_log_prob]' "
    report = planner.check(
        base + stages + "algorithm.rollout_correction.bypass_mode=True\n",
        str(tmp_path / "x.sh"),
        mode="training",
    )
    assert "training.bypass_mode" in {v.rule for v in report.result.violations}


def test_default_steps_stay_inside_total_training_steps(tmp_path: Path) -> None:
    text = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm trainer.total_training_steps=1\n"
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run_x.sh"), mode="training", out_dir=str(tmp_path))
    )
    assert not p.violations and value(p, "global_profiler.steps") == [1]
    assert any("total_training_steps=1" in n for n in p.notes)
    longer = text.replace("=1\n", "=5\n")
    p = planner.plan(
        planner.PlanRequest(longer, str(tmp_path / "run_x.sh"), mode="training", out_dir=str(tmp_path))
    )
    assert value(p, "global_profiler.steps") == [1, 2]


def test_consistency_turns_bypass_mode_off(tmp_path: Path) -> None:
    text = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm algorithm.rollout_correction.bypass_mode=True\n"
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run_x.sh"), mode="consistency", out_dir=str(tmp_path))
    )
    assert not p.violations and value(p, "algorithm.rollout_correction.bypass_mode") is False


def test_fully_async_training_leaves_out_the_bypassed_stage(tmp_path: Path) -> None:
    p = plan("run_fully_async_qwen2_5_vllm.sh", "training", tmp_path)
    # no KL term in this script either: no reference model, so no ref_compute_log_prob
    assert value(p, "global_profiler.global_tool_config.precision_debugger.stages") == ["actor_update"]
    assert any("bypass_mode" in n for n in p.notes)
    c = plan("run_fully_async_qwen2_5_vllm.sh", "consistency", tmp_path)
    assert value(c, "algorithm.rollout_correction.bypass_mode") is False


def test_variables_the_script_exports_are_set_in_place_not_exported_again(tmp_path: Path) -> None:
    text = (CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_text()
    text = text.replace(
        "set -x\n", "set -x\nexport TORCHDYNAMO_DISABLE=1\nexport VLLM_USE_V2_MODEL_RUNNER=1\nFOO=1\n"
    )
    text = text.replace(" $@", " trainer.device=cuda $@")
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run.sh"), mode="inference", out_dir=str(tmp_path))
    )
    lines = p.derived_text.splitlines()
    assert [x for x in lines if x.startswith("export TORCHDYNAMO_DISABLE")] == [
        "export TORCHDYNAMO_DISABLE=1"
    ]
    assert [x for x in lines if x.startswith("export VLLM_USE_V2_MODEL_RUNNER")] == [
        "export VLLM_USE_V2_MODEL_RUNNER=1"  # the script's own line: no rule needs another runner
    ]
    assert sum(x.startswith("export MSPROBE_ROLLOUT_CONFIG=") for x in lines) == 1  # not in the script
    checked = planner.check(p.derived_text, str(tmp_path / "derived.sh"), mode="inference")
    assert not checked.result.violations, checked.result.violations


@pytest.mark.parametrize(
    ("kl", "ref_runs"),
    [
        ("actor_rollout_ref.actor.use_kl_loss=False", False),
        (
            "actor_rollout_ref.actor.use_kl_loss=False algorithm.use_kl_in_reward=True",
            True,
        ),  # the later one wins
        ("actor_rollout_ref.actor.use_kl_loss=$KL", None),  # decided at run time: keep the stage
    ],
)
def test_ref_stage_only_where_a_reference_model_runs(tmp_path: Path, kl: str, ref_runs: bool | None) -> None:
    text = (CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_text()
    text = text.replace("actor_rollout_ref.actor.use_kl_loss=True", kl).replace(
        "algorithm.use_kl_in_reward=False", ""
    )
    p = planner.plan(
        planner.PlanRequest(text, str(tmp_path / "run.sh"), mode="training", out_dir=str(tmp_path))
    )
    stages = value(p, "global_profiler.global_tool_config.precision_debugger.stages")
    assert ("ref_compute_log_prob" in stages) is (ref_runs is not False)
    assert (value(p, "actor_rollout_ref.ref.profiler.enable") is True) is (ref_runs is not False)
    assert any("No reference model runs" in n for n in p.notes) is (ref_runs is False)
    asked = planner.plan(
        planner.PlanRequest(
            text,
            str(tmp_path / "run.sh"),
            mode="training",
            out_dir=str(tmp_path),
            options=Options(stages=["ref_compute_log_prob"]),
        )
    )
    missing = [n for n in asked.notes if "its dumps will be missing" in n]
    assert bool(missing) is (ref_runs is False)


def test_consistency_actor_computes_in_the_rollout_dtype(tmp_path: Path) -> None:
    """FSDP mixed precision's param_dtype (bf16 by default) is what the actor's forward computes
    in; consistency sets it to the rollout's dtype, and check enforces it."""
    base = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm "
        "actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.fsdp_config.dtype=float32 "
    )
    key = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
    fp32 = planner.plan(
        planner.PlanRequest(
            base + "actor_rollout_ref.rollout.dtype=float32\n",
            str(tmp_path / "a.sh"),
            mode="consistency",
            out_dir=str(tmp_path),
        )
    )
    assert value(fp32, key) == "fp32" and f"++{key}=fp32" in fp32.derived_text
    assert planner.check(fp32.derived_text, str(tmp_path / "a_msprobe.sh"), mode="consistency").result.ok
    bf16 = planner.plan(
        planner.PlanRequest(base + "\n", str(tmp_path / "b.sh"), mode="consistency", out_dir=str(tmp_path))
    )
    assert value(bf16, key) == "bf16"  # rollout bf16 (verl's default): written out explicitly
    assert planner.check(base + "\n", str(tmp_path / "b0.sh"), mode="consistency").result.ok is False
    assert key not in {
        v.key
        for v in planner.check(base + "\n", str(tmp_path / "b0.sh"), mode="consistency").result.violations
    }
    report = planner.check(
        base + "actor_rollout_ref.rollout.dtype=float32\n", str(tmp_path / "c.sh"), mode="consistency"
    )
    found = [v for v in report.result.violations if v.key == key]
    assert found and found[0].required == "fp32" and "not set" in found[0].found and "bf16" in found[0].fix
    as_dict = (
        base
        + "actor_rollout_ref.rollout.dtype=float32 '++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32}'\n"
    )
    report = planner.check(as_dict, str(tmp_path / "d.sh"), mode="consistency")
    assert key not in {v.key for v in report.result.violations}
    auto = planner.check(
        base + "actor_rollout_ref.rollout.dtype=auto\n", str(tmp_path / "e.sh"), mode="consistency"
    )
    assert any("rollout.dtype is auto" in u for u in auto.result.unverifiable)


@pytest.mark.parametrize(
    ("entry", "applies"),
    [
        ("verl.trainer.main_eval", ()),
        ("verl.trainer.main_generation", ()),
        ("verl.trainer.sft_trainer", ()),
        ("verl.trainer.main_generation_server", ("inference",)),
        ("recipe.dapo.main_dapo", ("training", "inference", "consistency")),
    ],
)
def test_modes_apply_to_rl_entry_points_only(entry: str, applies: tuple[str, ...], tmp_path: Path) -> None:
    text = f"python3 -m {entry} actor_rollout_ref.rollout.name=vllm\n"
    for mode in ("training", "inference", "consistency"):
        p = planner.plan(
            planner.PlanRequest(text, str(tmp_path / "run_x.sh"), mode=mode, out_dir=str(tmp_path))
        )
        wrong = [v for v in p.violations if v.rule == "entry_point"]
        assert bool(wrong) is (mode not in applies), (mode, p.violations)
        assert p.refused is bool(wrong) or not wrong
        if wrong:
            assert entry in wrong[0].found and wrong[0].fix
    if not applies:
        with pytest.raises(UserError, match="no collection mode applies"):
            planner.plan(planner.PlanRequest(text, str(tmp_path / "run_x.sh"), out_dir=str(tmp_path)))


def test_generation_server_is_offered_inference() -> None:
    text = "python3 -m verl.trainer.main_generation_server actor_rollout_ref.rollout.name=vllm\n"
    _, detection = planner.detect_text(text, "/tmp/run_gen.sh")
    assert detection.mode == "inference" and any("generation-only" in r for r in detection.reasons)


def test_several_commands_take_the_training_job_and_command_n_chooses(tmp_path: Path) -> None:
    text = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm trainer.nnodes=1\n"
        "python3 -m verl.trainer.main_eval data.path=x\n"
    )
    script, detection = planner.detect_text(text, "/tmp/run_two.sh")
    assert script.command is not None and script.command.entry == "verl.trainer.main_ppo"
    assert any("2 verl commands found" in r and "--command N" in r for r in detection.reasons)
    script, _ = planner.detect_text(text, "/tmp/run_two.sh", command=2)
    assert script.command is not None and script.command.entry == "verl.trainer.main_eval"
    with pytest.raises(UserError, match="--command 3"):
        planner.detect_text(text, "/tmp/run_two.sh", command=3)
    p = planner.plan(
        planner.PlanRequest(
            text, str(tmp_path / "run_two.sh"), mode="training", out_dir=str(tmp_path), command=2
        )
    )
    assert p.refused and p.violations[0].rule == "entry_point"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("ending", ["", "\n"], ids=["no-final-newline", "final-newline"])
def test_a_last_line_ending_in_a_backslash_gets_no_stray_token(ending: str, tmp_path: Path) -> None:
    from tests.support.bash_argv import record

    original = tmp_path / "run_x.sh"
    original.write_text(
        'ARGS=(actor_rollout_ref.rollout.name=vllm)\npython3 -m verl.trainer.main_ppo \\\n    "${ARGS[@]}" \\'
        + ending
    )
    p = planner.plan(
        planner.PlanRequest(original.read_text(), str(original), mode="training", out_dir=str(tmp_path))
    )
    assert not p.violations
    derived = tmp_path / "run_profiler_x.sh"
    derived.write_text(p.derived_text)
    (before,) = record(original, tmp_path / "bash")
    (after,) = record(derived, tmp_path / "bash")
    assert after[: len(before)] == before
    added = after[len(before) :]
    assert [parse_override(t).key for t in added] == [
        "global_profiler.tool",
        "global_profiler.steps",
        "global_profiler.save_path",
        "global_profiler.global_tool_config.precision_debugger.config_path",
        "global_profiler.global_tool_config.precision_debugger.stages",
        "actor_rollout_ref.actor.profiler.enable",  # no reference model runs (no KL): no ref stage
    ]


def test_prepare_with_one_python_prints_one_apply_for_every_tree(tmp_path: Path) -> None:
    """verl and vLLM both found through one --python: one `patch apply` for the two trees (all or none);
    a --tree of its own keeps its own command."""
    site = tmp_path / "site"
    (site / "verl" / "version").mkdir(parents=True)
    (site / "verl" / "version" / "version").write_text("0.9.1\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "_version.py").write_text('__version__ = "0.33.0"\n')
    for package in ("verl", "vllm"):
        (site / package / "__init__.py").write_text("raise SystemExit('imported!')\n")
    v2_runner = site / "vllm" / "v1" / "worker" / "gpu" / "model_runner.py"  # a dump path for vllm-dump
    v2_runner.parent.mkdir(parents=True)
    v2_runner.write_bytes((FIXTURES / "vllm-v2-model-runner" / "v0240.before.py").read_bytes())
    script = tmp_path / "run_x.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    python = f"env PYTHONPATH={site} {sys.executable}"
    code, out, err = cli("prepare", str(script), "--mode", "consistency", "--python", python, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["entry_point"] == "main_ppo"
    assert doc["patch_commands"] == [
        f"rl-msprobe patch apply {' '.join(doc['patch_sets'])} --python {shlex.quote(python)} --for main_ppo"
    ]
    assert doc["patch_sets"] == ["verl-consistency", "vllm-dump"]
    targets = {"verl": f"--tree {site}", "vllm": f"--python {python}"}
    assert planner.patch_commands(doc["patch_sets"], targets, "main_ppo") == [
        f"rl-msprobe patch apply verl-consistency --tree {site} --for main_ppo",
        f"rl-msprobe patch apply vllm-dump --python {python}",
    ]


def _plan_text(text: str, tmp_path: Path, **options: object) -> planner.Plan:
    """The original skill's plan (--batch-one): its whole-response dumps and their size check."""
    request = planner.PlanRequest(
        text,
        str(tmp_path / "run.sh"),
        mode="consistency",
        out_dir=str(tmp_path),
        options=Options(batch_one=True, **options),  # type: ignore[arg-type]
    )
    return planner.plan(request)


def _with_local_model(tmp_path: Path, layers: int = 28) -> str:
    """The 7B fixture (prompt 512, response 1024) with its model path on a local config.json."""
    model = tmp_path / "Qwen2-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": 3584}))
    text = (CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_text()
    assert "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct" in text
    return text.replace(
        "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", f"actor_rollout_ref.model.path={model}"
    )


def test_consistency_records_positions_and_prints_the_size_for_the_model(tmp_path: Path) -> None:
    p = _plan_text(_with_local_model(tmp_path), tmp_path, max_dump_gib=1000)
    env = dict((n, v) for n, v, _ in p.env)
    assert env["DUMP_POSITIONS"] == "1"
    (note,) = [n for n in p.notes if n.startswith("Whole-response consistency:")]
    assert "for 28 layers" in note and "prompt 512 and response 1024" in note, note
    gib = float(note.split("step (")[1].split("): ")[1].split(" GiB")[0])
    # 8 requests (rollout.n = DP = 8) of a 7B model, 1k-token responses, every step on 8 TP ranks
    assert "8 request(s), rollout TP 8" in note and 100 < gib < 500, note
    assert not p.violations
    default = _plan_text(_with_local_model(tmp_path / "again"), tmp_path)
    assert [v.rule for v in default.violations] == ["consistency.dump_size"]  # past the default 50 GiB
    print(f"prepare's whole-response estimate, Qwen2-7B, prompt 512, response 1024: {note}")


def test_consistency_refuses_a_dump_past_the_limit_and_prefill_only_skips_it(tmp_path: Path) -> None:
    text = _with_local_model(tmp_path)
    p = _plan_text(text, tmp_path, max_dump_gib=0.5)
    (bad,) = [v for v in p.violations if v.rule == "consistency.dump_size"]
    assert (
        "--max-dump-gib 0.5" in bad.fix
        and "--prefill-only" in bad.fix
        and bad.key == "data.max_response_length"
    )
    # --prefill-only: no records, and the vllm-dump helper skips the decode steps (told, with the size)
    only = _plan_text(text, tmp_path, prefill_only=True, max_dump_gib=0.5)
    env = dict((n, v) for n, v, _ in only.env)
    assert not only.violations and "DUMP_POSITIONS" not in env, only.violations
    assert env["MSPROBE_ROLLOUT_PHASES"] == "prefill" and "vllm-dump" in only.patch_sets
    (note,) = [n for n in only.notes if n.startswith("Prefill-only consistency:")]
    assert "per-token records 0)" in note and "decode steps are not dumped" in note, note


def test_consistency_batch_one_on_megatron_sets_no_positions_its_engine_refuses(tmp_path: Path) -> None:
    """The patched Megatron engine raises on DUMP_POSITIONS=1 (FSDP only): the batch-one plan compares the
    prefill there and says so (issue 45)."""
    p = plan("run_deepseek_megatron_vllm.sh", "consistency", tmp_path, batch_one=True)
    env = dict((n, v) for n, v, _ in p.env)
    assert "DUMP_POSITIONS" not in env and env.get("MSPROBE_ROLLOUT_PHASES") == "prefill", env
    assert any(n.startswith("Megatron: this plan's per-token positions") for n in p.notes), p.notes
    fsdp = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path / "fsdp", batch_one=True)
    assert dict((n, v) for n, v, _ in fsdp.env)["DUMP_POSITIONS"] == "1"


def test_consistency_without_a_readable_model_says_there_is_no_estimate(tmp_path: Path) -> None:
    p = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path, batch_one=True)
    (note,) = [n for n in p.notes if n.startswith("Whole-response consistency:")]
    assert "no size estimate" in note and "the model is unknown" in note and "pass --model-config" in note
    # the default plan says the same of its records, and why (a hub id not in the Hugging Face cache)
    default = plan("run_qwen2_7b_grpo_fsdp_vllm.sh", "consistency", tmp_path / "default")
    (records,) = [n for n in default.notes if n.startswith("Records:")]
    assert (
        "no size estimate" in records
        and "no models--Qwen--Qwen2-7B-Instruct in the Hugging Face cache" in records
    )

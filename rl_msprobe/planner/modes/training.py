"""Training collection: verl's own `global_profiler` with tool `precision_debugger`.

Rules (specification path A; DOMAIN §1, §3):
- verl ≥ 0.8.0 (the precision_debugger tool does not exist before); Megatron dumps work from 0.9.0;
- `global_profiler.tool=precision_debugger`, `global_profiler.steps` (required, else nothing
  starts), `global_profiler.save_path` absolute (the default is relative to the Ray worker's
  cwd), `++...precision_debugger.config_path`, `++...precision_debugger.stages` listing the
  stages (all three unless `--stages`);
- `actor_rollout_ref.actor.profiler.enable=True` (it also gates the ref in the fused worker),
  `actor_rollout_ref.ref.profiler.enable=True` when the ref stage is collected;
- the msprobe config must NOT set `dump_path` (verl replaces it); no source change.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rl_msprobe.launch.detect import STAGES
from rl_msprobe.launch.overrides import format_value
from rl_msprobe.planner.modes.base import ConfigSpec, Context, Requirements, Violation, is_abs_path, is_true
from rl_msprobe.planner.modes.rules import From, Rule, VersionRule, apply, first_too_old
from rl_msprobe.planner.msprobe_config import DUMP_PATH_RE

TOOL_CONFIG = "global_profiler.global_tool_config.precision_debugger."
DEFAULT_STEPS = [1, 2]


def _steps_ok(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    )


def _stages_ok(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(v in STAGES for v in value)


KL_KEYS = ("algorithm.use_kl_in_reward", "actor_rollout_ref.actor.use_kl_loss")


def _reference_runs(ctx: Context) -> bool | None:
    """verl builds a reference model only for a KL term (its need_reference_policy: either KL_KEYS
    switch on; both default off). None when the script leaves one to run time."""
    found = [ctx.value(key) for key in KL_KEYS]
    if any(origin == "runtime" for _, origin in found):
        return None
    return any(is_true(value) for value, _ in found)


def _save_path_ok(value: object) -> bool:
    # verl passes {save_path}/step_N/STAGE to msprobe as dump_path, which must match msprobe's pattern
    return is_abs_path(value) and bool(DUMP_PATH_RE.match(value))


def _steps_run(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str]]:
    """Profiled steps the job reaches, and stages that actually fire."""
    out: list[Violation] = []
    steps = _script_value(ctx, "global_profiler.steps", _steps_ok) or next(
        (s.value for s in req.settings if s.key == "global_profiler.steps"), None
    )
    total = ctx.int_value("trainer.total_training_steps")
    if steps and total is not None and max(steps) > total:
        out.append(
            Violation(
                "training.steps_in_range",
                "global_profiler.steps",
                format_value(steps),
                f"steps <= trainer.total_training_steps ({total})",
                f"profile steps the job reaches, or raise trainer.total_training_steps to {max(steps)}",
            )
        )
    stages = _script_value(ctx, TOOL_CONFIG + "stages", _stages_ok) or []
    bypass, _ = ctx.value("algorithm.rollout_correction.bypass_mode")
    if "actor_compute_log_prob" in stages and str(bypass).lower() == "true":
        out.append(
            Violation(
                "training.bypass_mode",
                "algorithm.rollout_correction.bypass_mode",
                "True",
                "False while actor_compute_log_prob is collected",
                "bypass mode reuses the rollout's log-probs, so actor_compute_log_prob never runs: drop that stage "
                "or set algorithm.rollout_correction.bypass_mode=False",
            )
        )
    return out, []


def _default_steps(ctx: Context) -> list[int]:
    """Steps 1 and 2, kept inside trainer.total_training_steps when the job is shorter."""
    total = ctx.int_value("trainer.total_training_steps")
    return list(DEFAULT_STEPS) if total is None or total >= 2 else [1]


def _script_value(ctx: Context, key: str, accept: Callable[[Any], bool]) -> Any:
    found = ctx.overrides.get(key)
    return found.value if found is not None and accept(found.value) else None


def _bypass(ctx: Context) -> bool:
    return str(ctx.value("algorithm.rollout_correction.bypass_mode")[0]).lower() == "true"


def _stages(ctx: Context) -> list[str]:
    """--stages, else what the script lists, else every stage that runs."""
    no_ref = _reference_runs(ctx) is False
    skipped = {"actor_compute_log_prob"} if _bypass(ctx) else set()
    default = [s for s in STAGES if s not in skipped and not (no_ref and s == "ref_compute_log_prob")]
    return list(ctx.options.stages or _script_value(ctx, TOOL_CONFIG + "stages", _stages_ok) or default)


def _collected_stages(ctx: Context) -> list[str]:
    """The stages the job will collect: the script's own list wins unless --stages was given."""
    found = _script_value(ctx, TOOL_CONFIG + "stages", _stages_ok)
    return found if found is not None and ctx.options.stages is None else _stages(ctx)


def _steps(ctx: Context) -> list[int]:
    return list(
        ctx.options.steps or _script_value(ctx, "global_profiler.steps", _steps_ok) or _default_steps(ctx)
    )


def _save_path(ctx: Context) -> str:
    """--dump-dir's training folder; else a valid save_path the script already sets, else that folder."""
    ours = os.path.join(ctx.dump_dir, "training")
    if ctx.dump_dir_given:
        return ours
    return _script_value(ctx, "global_profiler.save_path", _save_path_ok) or ours


VERSIONS = (
    VersionRule(
        "training.verl_version",
        "verl",
        "0.8.0",
        "verl's precision_debugger profiler tool exists from 0.8.0: upgrade verl "
        "(or use consistency mode, which patches the engine)",
    ),
    VersionRule(
        "training.megatron_version",
        "verl",
        "0.9.0",
        "verl's precision_debugger dumps work on the Megatron engine from 0.9.0: upgrade verl",
        when=lambda ctx: ctx.backend == "megatron",
    ),
)

SETTINGS = (
    Rule("training.tool", "global_profiler.tool", "precision_debugger", "verl's msprobe profiler tool"),
    Rule(
        "training.steps",
        "global_profiler.steps",
        From(_steps),
        "required: without steps the profiler never starts",
        accept=_steps_ok,
        required="a non-empty list of training steps, e.g. [1,2]",
    ),
    Rule(
        "training.save_path",
        "global_profiler.save_path",
        From(_save_path),
        "the default outputs/profile is relative to each Ray worker's cwd",
        accept=_save_path_ok,
        required="an absolute folder of letters, digits and _ . : / - (msprobe's dump_path rule)",
    ),
    Rule(
        "training.config_path",
        TOOL_CONFIG + "config_path",
        From(lambda ctx: os.path.join(ctx.config_dir, "config.json")),
        "the msprobe config (level mix, no dump_path)",
        prefix="++",
        accept=is_abs_path,
        required="an absolute path to the training config",
    ),
    Rule(
        "training.stages",
        TOOL_CONFIG + "stages",
        From(_stages),
        "which of actor_compute_log_prob, ref_compute_log_prob, actor_update to dump",
        prefix="++",
        accept=_stages_ok,
        required=f"a non-empty list from {list(STAGES)}",
    ),
    Rule(
        "training.actor_profiler",
        "actor_rollout_ref.actor.profiler.enable",
        True,
        "the actor role's profiler (also gates the ref in the fused worker)",
        accept=is_true,
    ),
    Rule(
        "training.ref_profiler",
        "actor_rollout_ref.ref.profiler.enable",
        True,
        "the ref role's profiler, for ref_compute_log_prob",
        when=lambda ctx: "ref_compute_log_prob" in _collected_stages(ctx),
        accept=is_true,
    ),
)


def _notes(ctx: Context) -> list[str]:
    notes = []
    if _bypass(ctx) and not ctx.options.stages:
        notes.append(
            "algorithm.rollout_correction.bypass_mode is on (fully-async's default): verl reuses the rollout's "
            "log-probs, so actor_compute_log_prob never runs and is left out of the stages."
        )
    chosen_steps = ctx.options.steps or _script_value(ctx, "global_profiler.steps", _steps_ok)
    if not chosen_steps and _default_steps(ctx) != DEFAULT_STEPS:
        notes.append(
            f"trainer.total_training_steps={ctx.int_value('trainer.total_training_steps')}: profiling step 1 only "
            f"(the default steps are {DEFAULT_STEPS})."
        )
    if _reference_runs(ctx) is False:
        notes.append(
            "No reference model runs (algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are off): "
            + (
                "ref_compute_log_prob is asked for but never runs, so its dumps will be missing."
                if "ref_compute_log_prob" in _collected_stages(ctx)
                else "ref_compute_log_prob never runs and is left out of the stages."
            )
        )
    notes.append(
        "Output: {save_path}/step_{global_step}/{stage}/step0/rank{R}/dump.json, one folder per stage and step."
    )
    if ctx.version("verl") is None:
        notes.append("verl version unknown: training mode needs verl >= 0.8.0 (Megatron: >= 0.9.0).")
    return notes


def requirements(ctx: Context) -> Requirements:
    req = Requirements()
    too_old_verl = first_too_old(ctx, VERSIONS)
    if too_old_verl is not None:
        req.violations.append(too_old_verl)
    req.configs.append(ConfigSpec("training", "config.json", None, TOOL_CONFIG + "config_path"))
    apply(ctx, req, SETTINGS)
    req.checks.append(_steps_run)
    req.notes.extend(_notes(ctx))
    return req

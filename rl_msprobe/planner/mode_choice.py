"""Which mode a plan or check runs, and that mode's rules on this job: the entry points a mode
cannot collect, the mode asked or detected, and the requirements from the mode table's module."""

from __future__ import annotations

from pathlib import Path

from rl_msprobe.errors import UserError
from rl_msprobe.launch.detect import Detection
from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import LaunchScript
from rl_msprobe.mode_table import get_mode, mode_names
from rl_msprobe.planner.modes import weights
from rl_msprobe.planner.modes.base import (
    Context,
    Options,
    Requirements,
    Violation,
)
from rl_msprobe.upstream.projects import project

# entry points the modes do not all apply to: kind -> (modes refused, why, what to do instead)
ENTRY_LIMITS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "sft": (
        mode_names(),
        "verl's SFT trainer has no rollout, no global_profiler stages and no training/inference pair",
        "collect an SFT run with msprobe's PrecisionDebugger in the trainer directly",
    ),
    "eval": (
        mode_names(),
        "main_eval only scores responses generated earlier: no model runs",
        "prepare the job that generates or trains (pass --command N when the script runs several)",
    ),
    "generation": (
        mode_names(),
        "main_generation reads its own generation config (rollout.*, no actor_rollout_ref / global_profiler)",
        "run generation with verl.trainer.main_generation_server (the PPO config) and inference mode",
    ),
    "generation_server": (
        ("training", "consistency"),
        "main_generation_server only generates: there is no training step",
        "use --mode inference (dumps the rollout engine)",
    ),
}


def entry_violation(script: LaunchScript, mode: str) -> Violation | None:
    """A violation when the chosen verl entry point is not a job this mode can collect."""
    assert script.command is not None
    limit = ENTRY_LIMITS.get(script.command.kind)
    if limit is None or mode not in limit[0]:
        return None
    modes, why, fix = limit
    applies = [m for m in mode_names() if m not in modes]
    return Violation(
        "entry_point",
        script.command.entry,
        f"{script.command.entry} (line {script.command.statement.line})",
        "a verl RL training entry point (main_ppo, the fully-async main, a recipe's PPO main)"
        + (f" for {mode} mode; this one suits {', '.join(applies)}" if applies else ""),
        f"{why}: {fix}",
    )


def choose_mode(detection: Detection, mode: str | None, path: str) -> str:
    """The mode asked for (checked against the mode table), else the one detected, else a UserError."""
    if mode:
        if mode not in mode_names():
            raise UserError(f"--mode {mode}: use one of {', '.join(mode_names())}.")
        return mode
    limit = ENTRY_LIMITS.get(detection.entry_kind)
    if detection.mode == "unknown" and limit is not None and set(limit[0]) == set(mode_names()):
        raise UserError(
            f"{path}: no collection mode applies: {limit[1]}. {limit[2][0].upper()}{limit[2][1:]}."
        )
    if detection.mode == "unknown":
        raise UserError(
            f"{path}: the collection mode cannot be decided from the script. "
            "Pass --mode training|inference|consistency, or --hint with what you want to collect."
        )
    return detection.mode


def build_context(
    script: LaunchScript,
    detection: Detection,
    versions: dict[str, str | None],
    options: Options,
    config_dir: str,
    dump_dir: str,
    dump_dir_given: bool = False,
    vllm_root: Path | None = None,
) -> Context:
    """What a mode's rules read: the script, its overrides, the detection, versions and choices."""
    assert script.command is not None
    return Context(
        script,
        Overrides(script.command.args),
        detection,
        dict(versions),
        options,
        config_dir,
        dump_dir,
        dump_dir_given,
        vllm_root,
    )


def requirements(ctx: Context, mode: str) -> Requirements:
    """The mode's rules on this job (its row's module), or the entry point it cannot collect."""
    wrong_entry = entry_violation(ctx.script, mode)
    if wrong_entry is not None:
        return Requirements(violations=[wrong_entry])
    row = get_mode(mode)
    req: Requirements = row.rules().requirements(ctx)
    stray = [name for name in req.patch_sets if name not in row.patch_sets]
    if stray:  # a bug of rl-msprobe's, never of the user's script: the table is what docs and --help say
        raise RuntimeError(
            f"mode {mode}'s rules ask for patch set(s) {stray}, which its row of the Mode table "
            "(rl_msprobe/mode_table.py, patch_sets) does not list: add them there"
        )
    assert ctx.script.command is not None
    assumed = [a for arg in ctx.script.command.args for a in arg.value.assumed]
    req.notes.extend(f"assumed: {a}" for a in dict.fromkeys(assumed))
    if ctx.versions.get("verl") is None and mode != "training":
        python = ctx.options.python
        how = (
            f"--python {python} does not import verl: pass --tree with the verl that runs the job"
            if python
            else "pass --tree or --python to detect it"
        )
        req.notes.append(f"verl version unknown: assuming {project('verl').assumed_version} ({how}).")
    return req


def mode_requirements(ctx: Context, mode: str, with_weights: bool) -> Requirements:
    """The mode's requirements, with the weight fingerprints on top when asked (and not refused)."""
    req = requirements(ctx, mode)
    if with_weights and mode != "weights" and not req.violations:
        weights.add(ctx, req)
    return req

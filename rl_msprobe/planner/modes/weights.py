"""Weight parity: fingerprints of what the actor sends at every weight sync, what each vLLM TP
rank receives, and what it holds after loading (issue 22). Cheap enough to leave on.

Rules:
- env `RL_MSPROBE_WEIGHTS_DIR=<dump-dir>/weights` reaching the actor workers and the vLLM
  workers (through ray_init.runtime_env like every other variable);
- patch set `verl-weights` (the actor's `update_weights`, the vLLM worker extension's sync);
- the rollout must be vLLM (the SGLang sync is not fingerprinted yet).
No msprobe, no dumps, no batch or parallelism constraint: the job is otherwise unchanged.
`--weights` adds the same to any other mode.
"""

from __future__ import annotations

import os
import shlex

from rl_msprobe.planner.modes.base import Context, EnvVar, Requirements, Violation, is_abs_path

WEIGHTS_ENV = "RL_MSPROBE_WEIGHTS_DIR"
SET = "verl-weights"


def weights_dir(ctx: Context) -> str:
    return os.path.join(ctx.dump_dir, "weights")


def add(ctx: Context, req: Requirements) -> Requirements:
    """Add the weight fingerprints to REQ (any mode's requirements)."""
    if ctx.detection.rollout == "sglang":
        req.violations.append(
            Violation(
                "weights.rollout",
                "actor_rollout_ref.rollout.name",
                "sglang",
                "vllm",
                "verl-weights fingerprints the vLLM worker extension's sync, not SGLang's: run the weight "
                "check on a vLLM rollout (or leave --weights off)",
            )
        )
        return req
    folder = weights_dir(ctx)
    req.env.append(
        EnvVar(
            "weights.env.RL_MSPROBE_WEIGHTS_DIR",
            WEIGHTS_ENV,
            folder,
            "the folder the patched weight sync writes its fingerprints to (actor and vLLM workers)",
            accept=is_abs_path,
        )
    )
    if SET not in req.patch_sets:
        req.patch_sets.append(SET)
    req.notes.append(
        f"Weights: {folder}/{{sent,received,resident}}-<host>-<pid>.jsonl, one line per tensor per sync. "
        f"After the run: rl-msprobe weights compare {shlex.quote(folder)} --out {shlex.quote(folder + '-report')}"
    )
    return req


def requirements(ctx: Context) -> Requirements:
    return add(ctx, Requirements())

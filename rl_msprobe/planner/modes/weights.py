"""Weight parity: fingerprints of what the actor sends at every weight sync, what each rollout TP
rank receives, and what it holds after loading (issue 22). Cheap enough to leave on.

Rules:
- env `RL_MSPROBE_WEIGHTS_DIR=<dump-dir>/weights` reaching the actor workers and the rollout's
  workers (through ray_init.runtime_env like every other variable);
- patch set `verl-weights` (the actor's `update_weights`, the vLLM worker extension's sync);
- an SGLang rollout also needs `sglang-weights` on the SGLang tree (its engine-side sync).
No msprobe, no dumps, no batch or parallelism constraint: the job is otherwise unchanged.
`--weights` adds the same to any other mode.
"""

from __future__ import annotations

import os
import shlex

from rl_msprobe.planner.modes.base import Context, EnvVar, Requirements, is_abs_path

WEIGHTS_ENV = "RL_MSPROBE_WEIGHTS_DIR"
SET = "verl-weights"
SGLANG_SET = "sglang-weights"


def weights_dir(ctx: Context) -> str:
    return os.path.join(ctx.dump_dir, "weights")


def add(ctx: Context, req: Requirements) -> Requirements:
    """Add the weight fingerprints to REQ (any mode's requirements)."""
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
    for name in (SET, SGLANG_SET) if ctx.detection.rollout == "sglang" else (SET,):
        if name not in req.patch_sets:
            req.patch_sets.append(name)
    req.notes.append(
        f"Weights: {folder}/{{sent,received,resident}}-<host>-<pid>.jsonl, one line per tensor per sync. "
        f"After the run: rl-msprobe weights compare {shlex.quote(folder)} --out {shlex.quote(folder + '-report')}"
    )
    return req


def requirements(ctx: Context) -> Requirements:
    return add(ctx, Requirements())

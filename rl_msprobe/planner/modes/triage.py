"""Mismatch triage: per-request, per-token log-prob gap between rollout and training, before any dump.

A cheap pass on the real job at full batch size that says how big the training–inference gap
is, where (step, request, response position, token) and whether it grows, and so which step
and request are worth a consistency dump. Rules (issue 13):
- `actor_rollout_ref.rollout.calculate_log_probs=True`: the rollout returns its log-probs, and
  verl then computes `training/rollout_probs_diff_*` right after the old-log-prob recompute;
- env `RL_MSPROBE_TRIAGE=<absolute folder>` reaching the trainer (a Ray actor), and
  `RL_MSPROBE_REQUEST_ID=1` reaching the rollout workers (request ids as in consistency);
- `algorithm.rollout_correction.bypass_mode=False` when the script (or fully-async) turns it
  on: bypass reuses the rollout's log-probs as the training ones, so there is no gap to see;
- patch sets `verl-triage` and `verl-request-id` (the ids a consistency dump joins on).
No msprobe, no dumps, no batch or parallelism constraint.
"""

from __future__ import annotations

import os
import shlex

from rl_msprobe.planner.modes.base import (
    Context,
    EnvVar,
    Requirements,
    Setting,
    is_abs_path,
    is_false,
    is_true,
)

R = "actor_rollout_ref.rollout."
TRIAGE_ENV = "RL_MSPROBE_TRIAGE"


def triage_dir(ctx: Context) -> str:
    return os.path.join(ctx.dump_dir, "triage")


def requirements(ctx: Context) -> Requirements:
    req = Requirements()
    req.add(
        Setting(
            "triage.calculate_log_probs",
            R + "calculate_log_probs",
            True,
            "",
            "the rollout returns its log-probs, so verl compares them with the training recompute",
            accept=is_true,
        )
    )
    if ctx.detection.fully_async or ctx.overrides.get("algorithm.rollout_correction.bypass_mode") is not None:
        req.add(
            Setting(
                "triage.bypass_mode",
                "algorithm.rollout_correction.bypass_mode",
                False,
                "",
                "bypass mode reuses the rollout's log-probs as the training ones: no gap would be measured",
                accept=is_false,
            )
        )
    folder = triage_dir(ctx)
    req.env.append(
        EnvVar(
            "triage.env.RL_MSPROBE_TRIAGE",
            TRIAGE_ENV,
            folder,
            "the folder the patched trainer writes one JSON line per request to",
            accept=is_abs_path,
        )
    )
    req.env.append(
        EnvVar(
            "triage.env.RL_MSPROBE_REQUEST_ID",
            "RL_MSPROBE_REQUEST_ID",
            "1",
            "the rollout keeps each request's id, so triage lines name the ids a consistency dump uses",
        )
    )
    if ctx.options.top_k:
        req.env.append(
            EnvVar(
                "triage.env.RL_MSPROBE_TRIAGE_TOPK",
                "RL_MSPROBE_TRIAGE_TOPK",
                str(ctx.options.top_k),
                "the rollout returns its top-k log-probs per response position and the trainer compares them with "
                "its own distribution at the same positions (prepare --top-k; 0: the sampled token only)",
            )
        )
    req.patch_sets += ["verl-triage", "verl-request-id", "verl-routing"]  # routing: MoE models only
    report = f"rl-msprobe mismatch report {shlex.quote(folder)} --script {shlex.quote(ctx.script.path)}"
    if ctx.options.python:  # the proposed consistency command then names it too
        report += f" --python {shlex.quote(ctx.options.python)}"
    req.notes.append(
        f"Output: {folder}/<pid>/triage.jsonl, one line per request per step. After (or during) the run: {report}"
    )
    return req

"""The verl-triage patch set: per-request rollout vs training log-prob lines, no msprobe.

Kept in its own module (one row in `patches/registry.py`) so the set can follow
the capability model of the other verl sets without touching them.
"""

from __future__ import annotations

from rl_msprobe.codemods.verl_triage import (
    VerlTriageRayTrainer,
    VerlTriageSeparateTrainer,
    VerlTriageSyncTrainer,
    VerlTriageV1Trainer,
)
from rl_msprobe.codemods.verl_triage_topk import (
    VerlTriageFsdpEngine,
    VerlTriageOldLogProb,
    VerlTriageVllmServer,
)
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece, runs_in, where_present
from rl_msprobe.patches.verl_entry_points import FULLY_ASYNC, MAIN_PPO, MAIN_PPO_SYNC, ONE_STEP_OFF
from rl_msprobe.upstream.projects import project

TRIAGE_FILE = NewFile("verl", "verl/utils/rl_msprobe_triage.py", name="verl-triage-file")


TRIAGE_LINES = Capability(
    "triage lines",
    "after `metrics.update(calculate_debug_metrics(...))` in every trainer the tree ships "
    "(RayPPOTrainer.fit always; the separation, main_ppo_sync and v1 trainers where present)",
    (
        "verl-triage-ray-trainer",
        "verl-triage-separate-trainer",
        "verl-triage-sync-trainer",
        "verl-triage-v1-trainer",
    ),
)


VERL_TRIAGE = PatchSet(
    name="verl-triage",
    project="verl",
    description="one JSON line per request (rollout vs training log-probs) where verl computes "
    "training/rollout_probs_diff_* (RL_MSPROBE_TRIAGE=<folder>)",
    pieces=(
        Piece(TRIAGE_FILE),
        runs_in(VerlTriageRayTrainer(), MAIN_PPO),
        where_present(
            VerlTriageSeparateTrainer(), "this tree has no separation trainer", (ONE_STEP_OFF, FULLY_ASYNC)
        ),
        where_present(VerlTriageSyncTrainer(), "this tree has no main_ppo_sync trainer", (MAIN_PPO_SYNC,)),
        where_present(VerlTriageV1Trainer(), "this tree has no v1 trainer", (MAIN_PPO,)),
        # the distribution per position (RL_MSPROBE_TRIAGE_TOPK=k): rollout top-k, trainer log-softmax
        where_present(VerlTriageVllmServer(), "this tree has no vLLM server rollout", (MAIN_PPO,)),
        where_present(
            VerlTriageOldLogProb(), "this tree's trainer has no _compute_old_log_prob", (MAIN_PPO,)
        ),
        where_present(VerlTriageFsdpEngine(), "this tree has no FSDP engine", (MAIN_PPO,)),
    ),
    capabilities=(TRIAGE_LINES,),
    min_version="0.7.0",
    max_version=project("verl").newest_tested,
    notes=(
        "Every trainer file the tree ships is patched after its `metrics.update(calculate_debug_metrics(...))` "
        "statement (found in verl 0.7.0 … 0.9.1); a shipped trainer file without it is not "
        "covered: listed, and `patch apply --for` an entry point that runs it refuses. ray_trainer.py is required.",
        "Active only with RL_MSPROBE_TRIAGE=<absolute folder> in the trainer's environment and "
        "actor_rollout_ref.rollout.calculate_log_probs=True (rl-msprobe prepare --mode triage sets both); then "
        "read the folder with `rl-msprobe mismatch report`.",
        "With RL_MSPROBE_TRIAGE_TOPK=k (prepare --mode triage sets 20; --top-k changes it) each line also carries "
        "the distribution at every response position: the vLLM server's top-k ids and log-probs, and the FSDP "
        "engine's log-softmax at the same positions (its top k, the rollout's ids, logsumexp, entropy), computed "
        "from the logits of the old-log-prob recompute (no second forward). Covered: RayPPOTrainer with the vLLM "
        "server and the FSDP engine; elsewhere the lines carry the sampled token only.",
        "Request ids in the lines come from verl-request-id (with RL_MSPROBE_REQUEST_ID=1): prepare --mode triage "
        "lists both sets; without it the lines carry verl's uid only.",
    ),
)

SETS = (VERL_TRIAGE,)

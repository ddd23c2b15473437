"""The verl consistency sets: PROMPTS_ONLY trimming, request ids, and verl-consistency (both plus
verl-engine)."""

from __future__ import annotations

from rl_msprobe.codemods.verl_request_id import (
    VerlAgentLoopRequestId,
    VerlAgentLoopTQRequestId,
    VerlFullyAsyncRolloutRequestId,
    VerlLLMServerRequestId,
)
from rl_msprobe.codemods.verl_trainer import (
    VerlFullyAsyncTrainer,
    VerlRayTrainer,
    VerlSeparateTrainer,
    VerlSyncTrainer,
    VerlV1Trainer,
)
from rl_msprobe.patches.patch_set import (
    Capability,
    NewFile,
    PatchSet,
    Piece,
    defines_class,
    runs_in,
    where_present,
)
from rl_msprobe.patches.verl import NEWEST, VERL_ENGINE
from rl_msprobe.patches.verl_entry_points import (
    EVERY_TRAINER,
    FULLY_ASYNC,
    MAIN_PPO,
    MAIN_PPO_SYNC,
    ONE_STEP_OFF,
)

CONSISTENCY_FILE = NewFile("verl", "verl/utils/rl_msprobe_consistency.py", name="verl-consistency-file")


TRIM = Capability(
    "PROMPTS_ONLY trim",
    "before the old-log-prob recompute of every trainer the tree has (RayPPOTrainer.fit always; the v1, "
    "main_ppo_sync, separation and fully-async trainers where present)",
    (
        "verl-ray-trainer",
        "verl-separate-trainer",
        "verl-sync-trainer",
        "verl-v1-trainer",
        "verl-fully-async-trainer",
    ),
)
REQUEST_ID = Capability(
    "request-id record",
    "around server.generate.remote in the rollout client that runs: AsyncLLMServerManager.generate "
    "(experimental/agent_loop/agent_loop.py, verl <= 0.7) or LLMServerClient.generate "
    "(workers/rollout/llm_server.py, verl >= 0.8)",
    ("verl-agent-loop-request-id", "verl-llm-server-request-id"),
)


VERL_PROMPTS_ONLY = PatchSet(
    name="verl-prompts-only",
    project="verl",
    description="PROMPTS_ONLY=1: a prompts-only copy's log-prob forward (the dumped prefill) before the "
    "old-log-prob recompute in every trainer of the version; the step trains on the full batch",
    pieces=(
        Piece(CONSISTENCY_FILE),
        runs_in(VerlRayTrainer(), MAIN_PPO),
        where_present(
            VerlSeparateTrainer(),
            "SeparateRayPPOTrainer (verl/experimental/separation) is in verl 0.7.1 and later",
            (ONE_STEP_OFF, FULLY_ASYNC),
        ),
        where_present(
            VerlSyncTrainer(),
            "verl/trainer/main_ppo_sync.py (TransferQueue trainer) is in verl 0.8.0",
            (MAIN_PPO_SYNC,),
        ),
        where_present(
            VerlV1Trainer(),
            "the v1 trainer (verl/trainer/ppo/v1/trainer_base.py) is in verl 0.9.0 and later",
            (MAIN_PPO,),
        ),
        where_present(
            VerlFullyAsyncTrainer(),
            "verl wheels ship it from 0.8.0; 0.7.1 has only its config; FullyAsyncTrainer inherits the "
            "patched SeparateRayPPOTrainer._fit_compute_log_prob anyway",
            (FULLY_ASYNC,),
        ),
    ),
    capabilities=(TRIM,),
    min_version="0.6.0",
    max_version=NEWEST,
    notes=(
        "Essential in every tree: RayPPOTrainer.fit (before the bypass_recomputing_logprobs line, or before "
        "the compute_log_prob call where there is none, as in 0.6.0). Patched wherever the tree has them: "
        "SeparateRayPPOTrainer._fit_compute_log_prob (0.7.1+), main_ppo_sync PPOTrainer (0.8.0), v1 "
        "PPOTrainer._compute_old_log_prob (0.9.0+, the default trainer), FullyAsyncTrainer._fit_generate "
        "(where the tree ships fully_async_trainer.py).",
        "The batch itself is never trimmed: the copy's forward is extra work per step (one prompt's "
        "prefill), and the step's own recompute and update see the full responses, so the job runs to "
        "its end. With PROMPTS_ONLY=1 the engine hook dumps only that copy's micro-batches.",
    ),
)

VERL_REQUEST_ID = PatchSet(
    name="verl-request-id",
    project="verl",
    description="the id each rollout request carries is kept in the output's extra_fields['request_id']",
    pieces=(
        Piece(CONSISTENCY_FILE),
        where_present(
            VerlAgentLoopRequestId(),
            "from verl 0.8.0 the rollout client is LLMServerClient in verl/workers/rollout/llm_server.py",
            EVERY_TRAINER,
        ),
        where_present(
            VerlLLMServerRequestId(),
            "before verl 0.8.0 the rollout client is AsyncLLMServerManager in agent_loop.py",
            EVERY_TRAINER,
        ),
        where_present(
            VerlFullyAsyncRolloutRequestId(),
            "the fully-async client is defined in fully_async_rollouter.py in verl 0.8.0 (in llm_server.py later)",
            (FULLY_ASYNC,),
        ),
        where_present(
            VerlAgentLoopTQRequestId(),
            "the v1 trainer's TransferQueue agent loop (verl/trainer/ppo/v1/agent_loop_tq.py) is in verl 0.9.0 "
            "and later",
            (MAIN_PPO,),
        ),
    ),
    capabilities=(REQUEST_ID,),
    min_version="0.6.0",
    max_version=NEWEST,
    notes=(
        "The rollout client the tree has is patched: AsyncLLMServerManager in agent_loop.py (0.6.0 - 0.7.1) "
        "or LLMServerClient in llm_server.py (0.8.0+); plus the fully-async client where the tree defines "
        "it and the v1 trainer's agent_loop_tq.py (request_id as a top-level TransferQueue field).",
        "Active only with DUMP_ON=1, PROMPTS_ONLY=1 or RL_MSPROBE_REQUEST_ID=1 in the rollout workers' "
        "environment; otherwise the inserted lines do nothing.",
    ),
)

VERL_CONSISTENCY = PatchSet(
    name="verl-consistency",
    project="verl",
    description="training-inference consistency: engine hooks + PROMPTS_ONLY trimming + request ids",
    includes=(VERL_ENGINE, VERL_PROMPTS_ONLY, VERL_REQUEST_ID),
    capabilities=(
        Capability(
            "engine runs the actor",
            "the actor's log-probs computed by the patched training engine",
            ("verl-fsdp-engine", "verl-megatron-engine"),
            probe=defines_class("verl/workers/engine_workers.py", "ActorRolloutRefWorker"),
            why=(
                "Without it (as in verl 0.6.x) the actor always runs the legacy workers (use_legacy_worker_impl "
                "switches only the critic and the reward model), so the patched training engine never "
                "computes the actor's log-probs and nothing would be dumped; use verl 0.7.0 or later. "
                "verl-prompts-only and verl-request-id alone do apply there."
            ),
        ),
    ),
    min_version="0.7.0",
    max_version=NEWEST,
    version_notes=VERL_ENGINE.version_notes,
)

SETS = (VERL_PROMPTS_ONLY, VERL_REQUEST_ID, VERL_CONSISTENCY)

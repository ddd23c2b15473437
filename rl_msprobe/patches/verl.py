"""Patch sets for verl."""

from __future__ import annotations

from rl_msprobe.codemods.verl_fsdp_engine import VerlFSDPEngine
from rl_msprobe.codemods.verl_megatron_engine import VerlMegatronEngine
from rl_msprobe.patches import NewFile, PatchSet, Piece, register

NEWEST = "0.9.1"  # newest verl release every verl set is tested on; the default release for `patch diff`

HOOKS_FILE = NewFile("verl", "verl/utils/rl_msprobe_hooks.py", name="verl-hooks-file")

VERL_ENGINE = register(
    PatchSet(
        name="verl-engine",
        project="verl",
        description="msprobe dump per micro-batch in the FSDP and Megatron training engines (DUMP_ON=1)",
        pieces=(Piece(HOOKS_FILE), Piece(VerlFSDPEngine()), Piece(VerlMegatronEngine())),
        min_version="0.6.0",
        max_version=NEWEST,
        version_notes=(
            (
                None,
                "0.7.1",
                "verl <= 0.7.1 runs the legacy workers by default: add trainer.use_legacy_worker_impl=disable "
                "so the patched engine runs (rl-msprobe prepare does).",
            ),
        ),
    )
)


# ---------------------------------------------------------------------------- consistency sets

from rl_msprobe.codemods.verl_request_id import (  # noqa: E402
    VerlAgentLoopRequestId,
    VerlAgentLoopTQRequestId,
    VerlFullyAsyncRolloutRequestId,
    VerlLLMServerRequestId,
)
from rl_msprobe.codemods.verl_trainer import (  # noqa: E402
    VerlFullyAsyncTrainer,
    VerlRayTrainer,
    VerlSeparateTrainer,
    VerlSyncTrainer,
    VerlV1Trainer,
)

CONSISTENCY_FILE = NewFile("verl", "verl/utils/rl_msprobe_consistency.py", name="verl-consistency-file")


def _only(codemod, why: str, needs_file: bool = False) -> Piece:
    """A piece that exists only for some versions: not-applicable (with `why`) outside its range.

    needs_file=False: inside its range the file must be there (a missing file is an error).
    """
    return Piece(codemod, essential=False, why_optional=why, needs_file=needs_file)


VERL_PROMPTS_ONLY = register(
    PatchSet(
        name="verl-prompts-only",
        project="verl",
        description="PROMPTS_ONLY=1: a prompts-only copy's log-prob forward (the dumped prefill) before the "
        "old-log-prob recompute in every trainer of the version; the step trains on the full batch",
        pieces=(
            Piece(CONSISTENCY_FILE),
            Piece(VerlRayTrainer()),
            _only(
                VerlSeparateTrainer(),
                "SeparateRayPPOTrainer (verl/experimental/separation) exists from verl 0.7.1",
            ),
            _only(
                VerlSyncTrainer(),
                "verl/trainer/main_ppo_sync.py (TransferQueue trainer) exists only in verl 0.8.0",
            ),
            _only(
                VerlV1Trainer(), "the v1 trainer (verl/trainer/ppo/v1/trainer_base.py) exists from verl 0.9.0"
            ),
            _only(
                VerlFullyAsyncTrainer(),
                "fully_async_trainer.py is not in this tree (verl wheels ship it from 0.8.0; 0.7.1 has only its "
                "config); FullyAsyncTrainer inherits the patched SeparateRayPPOTrainer._fit_compute_log_prob anyway",
                needs_file=True,
            ),
        ),
        min_version="0.6.0",
        max_version=NEWEST,
        notes=(
            "Essential for every version: RayPPOTrainer.fit (0.6.0: before the compute_log_prob call; 0.6.1+: "
            "before the bypass_recomputing_logprobs line). Required inside their ranges: "
            "SeparateRayPPOTrainer._fit_compute_log_prob (0.7.1+), main_ppo_sync PPOTrainer (0.8.0), v1 "
            "PPOTrainer._compute_old_log_prob (0.9.0+, the default trainer). Optional: FullyAsyncTrainer._fit_generate "
            "(where the tree ships fully_async_trainer.py).",
            "The batch itself is never trimmed: the copy's forward is extra work per step (one prompt's "
            "prefill), and the step's own recompute and update see the full responses, so the job runs to "
            "its end. With PROMPTS_ONLY=1 the engine hook dumps only that copy's micro-batches.",
        ),
    )
)

VERL_REQUEST_ID = register(
    PatchSet(
        name="verl-request-id",
        project="verl",
        description="the id each rollout request carries is kept in the output's extra_fields['request_id']",
        pieces=(
            Piece(CONSISTENCY_FILE),
            _only(
                VerlAgentLoopRequestId(),
                "from verl 0.8.0 the rollout client lives in verl/workers/rollout/llm_server.py",
            ),
            _only(
                VerlLLMServerRequestId(),
                "before verl 0.8.0 the rollout client is AsyncLLMServerManager (agent_loop.py)",
            ),
            _only(
                VerlFullyAsyncRolloutRequestId(),
                "FullyAsyncLLMServerClient is in fully_async_rollouter.py only in verl 0.8.0 (llm_server.py from 0.9.0)",
            ),
            _only(
                VerlAgentLoopTQRequestId(),
                "the v1 trainer's TransferQueue agent loop (verl/trainer/ppo/v1/agent_loop_tq.py) exists from verl 0.9.0",
            ),
        ),
        min_version="0.6.0",
        max_version=NEWEST,
        notes=(
            "Exactly one rollout-client file per version is required: agent_loop.py (0.6.0 - 0.7.1) or "
            "llm_server.py (0.8.0+); plus fully_async_rollouter.py in 0.8.0 and the v1 trainer's "
            "agent_loop_tq.py from 0.9.0 (request_id as a top-level TransferQueue field).",
            "Active only with DUMP_ON=1, PROMPTS_ONLY=1 or RL_MSPROBE_REQUEST_ID=1 in the rollout workers' "
            "environment; otherwise the inserted lines do nothing.",
        ),
    )
)

VERL_CONSISTENCY = register(
    PatchSet(
        name="verl-consistency",
        project="verl",
        description="training-inference consistency: engine hooks + PROMPTS_ONLY trimming + request ids",
        includes=("verl-engine", "verl-prompts-only", "verl-request-id"),
        min_version="0.7.0",
        max_version=NEWEST,
        below_min_reason=(
            "In verl 0.6.x the actor always runs the legacy workers (use_legacy_worker_impl switches only the "
            "critic and the reward model), so the patched training engine never computes the actor's log-probs "
            "and nothing would be dumped; verl-prompts-only and verl-request-id alone do apply there."
        ),
        version_notes=VERL_ENGINE.version_notes,
    )
)

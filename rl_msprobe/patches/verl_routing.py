"""The verl-routing patch set: MoE router decisions per token on the rollout and the trainer.

Kept in its own module (a row in `patches/registry.py`), like verl-triage and verl-weights.
"""

from __future__ import annotations

from rl_msprobe.codemods.verl_routing import VerlRoutingRollout, VerlRoutingTrainer
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece
from rl_msprobe.upstream.projects import project

ROUTING_FILE = NewFile("verl", "verl/utils/rl_msprobe_routing.py", name="verl-routing-file")

TRAINER = Capability(
    "trainer routing",
    "around `X = self.actor.infer_batch(data)` in ActorRolloutRefWorker (verl/workers/engine_workers.py: "
    "compute_log_prob, the old-log-prob recompute): the HF model's gate hooks record, without grad",
    ("verl-routing-trainer",),
)
ROLLOUT = Capability(
    "rollout routing",
    "the first statement of vLLMColocateWorkerExtension.update_weights_from_ipc "
    "(verl/workers/rollout/vllm_rollout/utils.py): the vLLM model's gate hooks, installed at the first sync",
    ("verl-routing-rollout",),
)

VERL_ROUTING = PatchSet(
    name="verl-routing",
    project="verl",
    description="MoE routing per token on both sides: each layer's top-k expert ids and the k-th/(k+1)-th "
    "router-logit margin (RL_MSPROBE_TRIAGE=<folder>; read with `rl-msprobe mismatch report`)",
    pieces=(Piece(ROUTING_FILE), Piece(VerlRoutingTrainer()), Piece(VerlRoutingRollout())),
    capabilities=(TRAINER, ROLLOUT),
    min_version="0.7.1",
    max_version=project("verl").newest_tested,
    notes=(
        "Active only with RL_MSPROBE_TRIAGE=<absolute folder> (prepare --mode triage sets it) and a model "
        "with MoE gates (a `...gate` module beside `experts` in `layers.<N>.`); a dense model gets no hook. "
        "RL_MSPROBE_ROUTING=0 turns it off.",
        "The trainer side hooks the HF model (FSDP engines); Megatron's router is not hooked. The rollout side "
        "is vLLM's V1 runner through verl's worker extension; SGLang rollouts are not covered.",
    ),
)

SETS = (VERL_ROUTING,)

"""The verl-weights patch set: weight-parity fingerprints on both sides of every weight sync.

Kept in its own module (a row per set in `patches/registry.py`), like verl-triage.
"""

from __future__ import annotations

from rl_msprobe.codemods.sglang_weights import SGLangWeightsReceived, SGLangWeightsUpdater
from rl_msprobe.codemods.verl_weights import VerlWeightsBucket, VerlWeightsReceived, VerlWeightsSent
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece, where_present
from rl_msprobe.upstream.projects import project

WEIGHTS_FILE = NewFile("verl", "verl/utils/rl_msprobe_weights.py", name="verl-weights-file")
ENV = "RL_MSPROBE_WEIGHTS_DIR"

SENT = Capability(
    "sent fingerprints",
    "after every `X, ... = self.actor.engine.get_per_tensor_param(...)` in ActorRolloutRefWorker "
    "(verl/workers/engine_workers.py: update_weights, colocated and checkpoint-engine paths)",
    ("verl-weights-sent",),
)
RECEIVED = Capability(
    "received + resident fingerprints",
    "vLLMColocateWorkerExtension.update_weights_from_ipc (one sync) and the first line of its _update_weights, "
    "before model.load_weights (verl/workers/rollout/vllm_rollout/utils.py)",
    ("verl-weights-received",),
)
BUCKET = Capability(
    "sent fingerprints carried in the bucket",
    "after each tensor's `bucket_meta[name] = {...}` in BucketedWeightSender, and each "
    "`metadata = self.socket.recv_pyobj()` and `on_bucket_received(...)` in BucketedWeightReceiver.receive_weights "
    "(verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py): the receiver measures a tensor only "
    "where its checksum differs from the sender's, and on TP 1 checksums it only where the engine's copy differs",
    ("verl-weights-bucket",),
)

VERL_WEIGHTS = PatchSet(
    name="verl-weights",
    project="verl",
    description=f"weight parity at every sync: what the actor sends, what each vLLM TP rank receives and "
    f"holds ({ENV}=<folder>; read it with `rl-msprobe weights compare`)",
    pieces=(
        Piece(WEIGHTS_FILE),
        Piece(VerlWeightsSent()),
        Piece(VerlWeightsReceived()),
        Piece(VerlWeightsBucket()),
    ),
    capabilities=(SENT, RECEIVED, BUCKET),
    min_version="0.7.1",
    max_version=project("verl").newest_tested,
    notes=(
        f"Active only with {ENV}=<absolute folder> in the job's environment (actor workers and the vLLM "
        "workers); unset, the marked lines return at once and torch is not touched. "
        "RL_MSPROBE_WEIGHTS_HASH=0 skips the bit-exact hash of sent and received tensors; "
        "RL_MSPROBE_WEIGHTS_STATS=all has the sender take the statistics too (default: lazy, the "
        "statistics only where a checksum cannot stand for them).",
        "The resident side is what the loader wrote (each layer just before vLLM processes / repacks its "
        "weights after loading) where vLLM repacks them (CPU), else the parameters after the sync; fused "
        "qkv_proj / gate_up_proj are split back by the layer's output_partition_sizes and the model's "
        "packed_modules_mapping; vocab padding rows are dropped.",
        "verl 0.7.0 loads weights inside vLLMAsyncRollout.update_weights (no worker extension): refused; "
        "the LoRA adapter path is not fingerprinted. SGLang rollouts: apply sglang-weights to the SGLang tree too.",
    ),
)

# The same helper file, in the SGLang tree: its scheduler processes need not import verl.
SGLANG_WEIGHTS_FILE = NewFile(
    "sglang",
    "sglang/srt/rl_msprobe_weights.py",
    name="sglang-weights-file",
    source=f"verl/{WEIGHTS_FILE.path}",
)
SGLANG_RECEIVED = Capability(
    "received + resident fingerprints",
    "the top-level class defining update_weights_from_tensor (ModelRunner in "
    "sglang/srt/model_executor/model_runner.py; WeightUpdater in "
    "model_executor/model_runner_components/weight_updater.py): the tensors after `_unwrap_tensor`, "
    "the flattened bucket after `reconstruct_tensors()`, and the parameters they went into when it returns",
    ("sglang-weights-received", "sglang-weights-updater"),
)

SGLANG_WEIGHTS = PatchSet(
    name="sglang-weights",
    project="sglang",
    description=f"weight parity at every sync, SGLang side: what each TP rank receives and holds ({ENV}=<folder>; "
    "with verl-weights on the verl tree for what the actor sends)",
    pieces=(
        Piece(SGLANG_WEIGHTS_FILE),
        where_present(
            SGLangWeightsReceived(), "SGLang up to 0.5.12 keeps update_weights_from_tensor in ModelRunner"
        ),
        where_present(SGLangWeightsUpdater(), "later SGLang releases move it to WeightUpdater"),
    ),
    capabilities=(SGLANG_RECEIVED,),
    min_version="0.4.6.post5",
    max_version="0.5.23",
    notes=(
        f"Active only with {ENV}=<absolute folder> in the SGLang scheduler's environment; unset, nothing is "
        "imported or computed.",
        "SGLang loads a sync bucket by bucket (one update_weights_from_tensor call each): each call is fingerprinted "
        "as it arrives, and each tensor where the model holds it once the call returns (fused qkv_proj / "
        "gate_up_proj split back by the layer's output_partition_sizes and the model's stacked-parameter mapping). "
        "A call bringing a name the current sync already has starts the next sync.",
        "Not fingerprinted: verl's delta sync (its flushes carry encoded deltas, not model tensors), LoRA adapters, "
        "update_weights_from_disk / _distributed / _ipc.",
    ),
)

SETS = (VERL_WEIGHTS, SGLANG_WEIGHTS)

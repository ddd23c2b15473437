"""verl-weights on every verl release the other verl sets support, and the vLLM code its resident
fingerprints read at run time on the vLLM releases the vllm-dump tests fetch (cached)."""

from __future__ import annotations

import pytest

from rl_msprobe.upstream.releases import fetch_release
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = [pytest.mark.release, pytest.mark.timeout(1200)]

FILES = {
    "verl/utils/rl_msprobe_weights.py",
    "verl/workers/engine_workers.py",
    "verl/workers/rollout/vllm_rollout/utils.py",
}
PATCHED = ["0.7.1", "0.8.0", "0.9.0", "0.9.1"]
# version -> words the refusal names: 0.6.x has no engine worker; 0.7.0 loads inside vLLMAsyncRollout
REFUSED = {
    "0.6.0": ("engine_workers.py", "ActorRolloutRefWorker"),
    "0.6.1": ("engine_workers.py", "ActorRolloutRefWorker"),
    "0.7.0": ("vllm_rollout/utils.py", "vLLMColocateWorkerExtension"),
}
VLLM = ["0.24.0", "0.30.0", "0.32.0", "0.33.0"]
# what rl_msprobe_weights.py reads from a live vLLM model: file -> words that must be there
VLLM_SHAPE = {
    "vllm/model_executor/layers/linear.py": (
        "output_partition_sizes",
        "output_dim",
        "def process_weights_after_loading",
    ),
    "vllm/model_executor/layers/vocab_parallel_embedding.py": ("shard_indices", "def num_org_elements"),
    "vllm/model_executor/models/qwen2.py": ("packed_modules_mapping", '"qkv_proj"', '"gate_up_proj"'),
    "vllm/model_executor/models/llama.py": ("packed_modules_mapping",),
    "vllm/distributed/parallel_state.py": (
        "def get_tensor_model_parallel_rank",
        "def get_tensor_model_parallel_world_size",
    ),
}


@pytest.mark.parametrize("version", PATCHED)
def test_full_cycle(version, tmp_path):
    tree = scratch_copy("verl", version, tmp_path / f"verl-{version}")
    status = full_cycle(tree, ["verl-weights"])
    (entry,) = status["sets"]
    assert entry["status"] == "applied"
    assert {f["path"] for f in entry["files"]} == FILES


@pytest.mark.parametrize("version", sorted(REFUSED))
def test_refused_where_a_sync_site_is_missing(version):
    code, _, err = run_cli("patch", "diff", "verl-weights", "--tree", f"release:verl=={version}")
    assert code == 2
    assert all(word in err for word in REFUSED[version]), err


@pytest.mark.parametrize("version", VLLM)
def test_the_vllm_names_the_resident_side_reads_exist(version):
    root = fetch_release("vllm", version)
    for path, words in VLLM_SHAPE.items():
        text = (root / path).read_text(encoding="utf-8")
        missing = [w for w in words if w not in text]
        assert not missing, f"vLLM {version} {path}: {missing}"

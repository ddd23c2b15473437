"""verl-weights on every verl release the other verl sets support, and the vLLM code its resident
fingerprints read at run time on the vLLM releases the vllm-dump tests fetch (cached); sglang-weights
on the SGLang releases the sglang sets support (ModelRunner's update_weights_from_tensor, cached
releases; 0.5.23's WeightUpdater is patched and run live in tests/live/test_sglang_inference_e2e.py)."""

from __future__ import annotations

import pytest

from rl_msprobe.upstream.release_cache import fetch_release
from tests.support.releases import older, supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = [pytest.mark.release, pytest.mark.timeout(1200)]

FILES = {
    "verl/utils/rl_msprobe_weights.py",
    "verl/workers/engine_workers.py",
    "verl/workers/rollout/vllm_rollout/utils.py",
    "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py",
}
PATCHED = supported("verl-weights")
# every release below the range -> words the refusal names: 0.6.x has no engine worker; 0.7.0 loads
# inside vLLMAsyncRollout
REFUSED = {
    "0.6.0": ("engine_workers.py", "ActorRolloutRefWorker"),
    "0.6.1": ("engine_workers.py", "ActorRolloutRefWorker"),
    "0.7.0": ("vllm_rollout/utils.py", "vLLMColocateWorkerExtension"),
}
VLLM = ["0.24.0", "0.30.0", "0.32.0", "0.33.0"]
PARALLEL_STATE = ("def get_tensor_model_parallel_rank", "def get_tensor_model_parallel_world_size")
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
    "vllm/distributed/parallel_state.py": PARALLEL_STATE,
}


def _cycle(project: str, version: str, patch_set: str, folder) -> set[str]:
    """Apply, check, re-apply, revert byte-exactly (tests/support/trees.full_cycle): the files patched."""
    status = full_cycle(scratch_copy(project, version, folder / f"{project}-{version}"), [patch_set])
    (entry,) = status["sets"]
    assert entry["status"] == "applied"
    return {f["path"] for f in entry["files"] if f["status"] == "applied"}


@pytest.mark.parametrize("version", newest_in_default(PATCHED))
def test_full_cycle(version, tmp_path):
    assert _cycle("verl", version, "verl-weights", tmp_path) == FILES


@pytest.mark.parametrize("version", newest_in_default(older("verl-weights")))
def test_refused_where_a_sync_site_is_missing(version):
    code, _, err = run_cli("patch", "diff", "verl-weights", "--tree", f"release:verl=={version}")
    assert code == 2
    assert all(word in err for word in REFUSED[version]), err


def _missing(project: str, version: str, shape: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Per file of the release, the words of SHAPE it lacks."""
    root = fetch_release(project, version)
    texts = {path: (root / path).read_text(encoding="utf-8") for path in shape}
    return {
        path: [w for w in words if w not in texts[path]]
        for path, words in shape.items()
        if any(w not in texts[path] for w in words)
    }


@pytest.mark.parametrize("version", newest_in_default(VLLM))
def test_the_vllm_names_the_resident_side_reads_exist(version):
    assert _missing("vllm", version, VLLM_SHAPE) == {}


SGLANG_FILES = {"sglang/srt/rl_msprobe_weights.py", "sglang/srt/model_executor/model_runner.py"}
# full cycle: the oldest release, the last 0.4, the first with a flattened-bucket path, the newest
# sglang-dump release and verl 0.9.1's pin; every other release the sglang sets' tests fetch (the
# cached ones): the lines land where they should
SGLANG_FULL = ["0.4.6.post5", "0.4.10.post2", "0.5.1", "0.5.10.post1", "0.5.12"]
SGLANG_DIFF = [
    "0.4.7.post1",
    "0.4.8.post1",
    "0.4.9.post2",
    "0.5.2",
    "0.5.3.post2",
    "0.5.3.post3",
    "0.5.6",
    "0.5.6.post2",
    "0.5.9",
    "0.5.11",
]
FLATTENED_SINCE = "0.5.1"


def _sglang_added(version: str) -> list[str]:
    code, out, err = run_cli(
        "patch", "diff", "sglang-weights", "--tree", f"release:sglang=={version}", "--exit-code"
    )
    assert code == 1, err
    return [
        line[1:].strip() for line in out.splitlines() if line.startswith("+") and "rl-msprobe:sglang" in line
    ]


@pytest.mark.parametrize("version", newest_in_default(SGLANG_FULL))
def test_sglang_full_cycle(version, tmp_path):
    assert _cycle("sglang", version, "sglang-weights", tmp_path) == SGLANG_FILES


@pytest.mark.parametrize("version", newest_in_default(SGLANG_FULL + SGLANG_DIFF))
def test_sglang_lines_per_shape(version):
    """The decorator, the received line after the per-rank unpacking and, from 0.5.1, the same
    line in the flattened-bucket path: one each, on ModelRunner."""
    from packaging.version import Version

    added = _sglang_added(version)
    received = [line for line in added if line.startswith("rl_msprobe_weights.call_received(self, ")]
    assert sum(line.startswith("@rl_msprobe_weights.engine_call") for line in added) == 1, added
    expected = (
        ["named_tensors", "reconstructed_tensors"]
        if Version(version) >= Version(FLATTENED_SINCE)
        else ["named_tensors"]
    )
    assert [line.split(", ")[1].split(")")[0] for line in received] == expected, added


# what rl_msprobe_weights.py reads from a live SGLang model (file -> words that must be there)
SGLANG_SHAPE = {
    "sglang/srt/layers/linear.py": ("output_partition_sizes", "output_dim"),
    "sglang/srt/layers/vocab_parallel_embedding.py": ("shard_indices", "def num_org_elements"),
    "sglang/srt/models/qwen2.py": ("bitsandbytes_stacked_params_mapping", '"qkv_proj"', '"gate_up_proj"'),
    "sglang/srt/models/llama.py": ("stacked_params_mapping",),
    "sglang/srt/distributed/parallel_state.py": PARALLEL_STATE,
}


@pytest.mark.parametrize("version", newest_in_default(SGLANG_FULL + SGLANG_DIFF))
def test_the_sglang_names_the_resident_side_reads_exist(version):
    assert _missing("sglang", version, SGLANG_SHAPE) == {}

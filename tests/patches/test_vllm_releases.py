"""vllm-dump on real upstream vLLM releases, fetched from the package index (the sdist's sources,
unpacked without building; cached under ~/.cache/rl-msprobe/releases).

Three tree shapes, each decided by the code found: V1 and V2 runners side by side (0.24.0 … 0.33.0,
both patched) and V2 only (0.34.0 removed `vllm/v1/worker/gpu_model_runner.py`). Releases without
the V2 runner predate the set's range (0.24.0); the fixture tree `tests/codemods/test_vllm_model_runner.py` builds
stands for that shape.
"""

from __future__ import annotations

import json
import os

import pytest

from rl_msprobe.codemods.vllm_model_runner import VllmModelRunner
from rl_msprobe.codemods.vllm_model_runner_v2 import VllmModelRunnerV2
from rl_msprobe.upstream import detect_version, fetch_release
from tests.support.releases import supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = [pytest.mark.release, pytest.mark.timeout(1200)]

V1 = "vllm/v1/worker/gpu_model_runner.py"
V2 = "vllm/v1/worker/gpu/model_runner.py"
RANGE = supported("vllm-dump")  # every release of its range (tests/support/releases.py)
NEWEST = RANGE[-1]  # 0.34.0, V2 only: the newest tested vLLM
NEWEST_WITH_V1 = "0.33.0"
# the full patch cycle, oldest to newest (tests/patches/test_releases.py reads it); the full tier
# adds the oldest release of the range and two between (0.30.0: V1's __init__ gains a decorator;
# 0.32.0: what the CPU e2e runs) to the newest of each shape
FULL_CYCLE = [RANGE[0], "0.30.0", "0.32.0", NEWEST_WITH_V1, NEWEST]
CYCLE = newest_in_default(FULL_CYCLE, keep=[NEWEST_WITH_V1])  # the newest of each shape by default
# every other release in the range (eight more sdist downloads, ~47 MB each): RL_MSPROBE_VLLM_ALL_RELEASES=1
EVERY = [v for v in RANGE if v not in FULL_CYCLE]
LINES = CYCLE + (
    [pytest.param(v, marks=pytest.mark.full) for v in EVERY]
    if os.environ.get("RL_MSPROBE_VLLM_ALL_RELEASES") == "1"
    else []
)


@pytest.mark.parametrize("version", CYCLE)
def test_full_cycle(tmp_path, version):
    """diff -> apply -> status applied -> second apply no-op -> revert byte-exact (full_cycle)."""
    tree = scratch_copy("vllm", version, tmp_path / f"vllm-{version}")
    assert detect_version(tree, "vllm") == version
    status = full_cycle(tree, ["vllm-dump"])
    files = {f["codemod"]: f for f in status["sets"][0]["files"]}
    assert files["vllm-v2-model-runner"]["detail"] == "5 marked lines in place"
    assert files["vllm-dump-file"]["status"] == "applied"
    assert files["vllm-records-file"]["status"] == "applied"
    (capability,) = status["sets"][0]["capabilities"]
    if (tree / V1).exists():
        assert files["vllm-model-runner"]["detail"] == "4 marked lines in place"
        assert capability["sites"] == [V1, V2]
    else:
        assert files["vllm-model-runner"]["status"] == "not-applicable"
        assert "is not in this tree" in files["vllm-model-runner"]["detail"]
        assert capability["sites"] == [V2]


@pytest.mark.parametrize("version", LINES)
def test_lines_land_where_intended(version):
    root = fetch_release("vllm", version)
    if (root / V1).exists():
        lines = VllmModelRunner().apply((root / V1).read_text(), version).splitlines()
        marked = [i for i, line in enumerate(lines) if line.endswith("# rl-msprobe:vllm-model-runner")]
        assert len(marked) == 4
        deco = next(i for i in marked if "@rl_msprobe_dump.dump_step" in lines[i])
        assert (
            lines[deco + 1].strip() == "@torch.inference_mode()" and "def execute_model(" in lines[deco + 2]
        )
        start = next(i for i in marked if "start_forward(self)" in lines[i])
        assert lines[start + 1].strip() == "model_output = self._model_forward("
        compile("\n".join(lines), V1, "exec")
    else:
        assert version == NEWEST
    text = VllmModelRunnerV2().apply((root / V2).read_text(), version)
    lines = text.splitlines()
    marked = [i for i, line in enumerate(lines) if line.endswith("# rl-msprobe:vllm-v2-model-runner")]
    assert len(marked) == 5
    deco = next(i for i in marked if "@rl_msprobe_dump.dump_step" in lines[i])
    assert lines[deco + 1].strip() == "@torch.inference_mode()" and "def execute_model(" in lines[deco + 2]
    # the logits of a V2 step are computed in sample_tokens: the records' hooks stay until it ends
    sample = next(i for i in marked if "@rl_msprobe_dump.sample_step" in lines[i])
    assert "def sample_tokens(" in "\n".join(lines[sample + 1 : sample + 4])
    # the start sits right before the eager forward, in the branch an enforce_eager engine takes,
    # and passes on the step's batch (a local of execute_model assigned before it)
    (start,) = [i for i in marked if "start_forward(self, input_batch)" in lines[i]]
    assert any(line.strip().startswith("input_batch = self.prepare_inputs(") for line in lines[deco:start])
    assert lines[start + 1].strip() == "model_output = self.model(**model_inputs)"
    assert "Eager" in lines[start - 1] or lines[start - 1].strip() == "else:"
    init = next(i for i in marked if "init_runner(self)" in lines[i])
    assert init < deco and lines[init].startswith("        rl_msprobe_dump")  # in a method body
    compile(text, V2, "exec")


def test_default_release_for_diff_is_the_newest():
    code, out, err = run_cli("patch", "diff", "vllm-dump", "--json", "--exit-code")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["version"] == NEWEST
    assert {f["path"] for f in doc["summary"]["files"]} == {
        "vllm/v1/worker/rl_msprobe_dump.py",
        "vllm/v1/worker/rl_msprobe_records.py",
        V2,
    }
    assert doc["summary"]["removed"] == 0
    assert [s["codemod"] for s in doc["skipped"]] == ["vllm-model-runner"]


def test_fetched_release_is_sources_only():
    root = fetch_release("vllm", NEWEST)
    assert not list(root.rglob("*.so")), "the sdist's sources, not a platform wheel"
    code, out, _ = run_cli("patch", "status", "vllm-dump", "--tree", f"release:vllm=={NEWEST}", "--json")
    assert code == 1 and json.loads(out)["sets"][0]["status"] == "absent"

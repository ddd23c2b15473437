"""vllm-dump on real upstream vLLM releases, fetched from the package index (the sdist's
sources, unpacked without building; cached under ~/.cache/rl-msprobe/releases)."""

from __future__ import annotations

import json
import os

import pytest

from rl_msprobe.codemods.vllm_model_runner import VllmModelRunner
from rl_msprobe.codemods.vllm_model_runner_v2 import VllmModelRunnerV2
from rl_msprobe.upstream import detect_version, fetch_release
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy

pytestmark = [pytest.mark.release, pytest.mark.timeout(1200)]

FULL_CYCLE = ["0.24.0", "0.33.0"]  # the oldest and newest release the set supports
APPLY_ONLY = ["0.30.0", "0.32.0"]  # __init__ gains a decorator in 0.30.0; 0.32.0 is what the CPU e2e runs
# every release in the range (eight more sdist downloads, ~47 MB each): RL_MSPROBE_VLLM_ALL_RELEASES=1
EVERY = ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.31.0"]
if os.environ.get("RL_MSPROBE_VLLM_ALL_RELEASES") == "1":
    APPLY_ONLY = sorted({*APPLY_ONLY, *EVERY}, key=lambda v: tuple(map(int, v.split("."))))


@pytest.mark.parametrize("version", newest_in_default(FULL_CYCLE))
def test_full_cycle(tmp_path, version):
    tree = scratch_copy("vllm", version, tmp_path / f"vllm-{version}")
    assert detect_version(tree, "vllm") == version
    status = full_cycle(tree, ["vllm-dump"])
    files = {f["codemod"]: f for f in status["sets"][0]["files"]}
    assert files["vllm-model-runner"]["detail"] == "4 marked lines in place"
    assert files["vllm-v2-runner-guard"]["status"] == "applied"
    assert files["vllm-dump-file"]["status"] == "applied"


@pytest.mark.parametrize("version", newest_in_default(FULL_CYCLE + APPLY_ONLY))
def test_lines_land_where_intended(version):
    root = fetch_release("vllm", version)
    runner = (root / VllmModelRunner.path).read_text()
    lines = VllmModelRunner().apply(runner, version).splitlines()
    marked = [i for i, line in enumerate(lines) if line.endswith("# rl-msprobe:vllm-model-runner")]
    assert len(marked) == 4
    deco = next(i for i in marked if "@rl_msprobe_dump.dump_step" in lines[i])
    assert lines[deco + 1].strip() == "@torch.inference_mode()" and "def execute_model(" in lines[deco + 2]
    start = next(i for i in marked if "start_forward(self)" in lines[i])
    assert lines[start + 1].strip() == "model_output = self._model_forward("
    compile("\n".join(lines), VllmModelRunner.path, "exec")
    v2 = VllmModelRunnerV2().apply((root / VllmModelRunnerV2.path).read_text(), version)
    guard = [line for line in v2.splitlines() if "refuse_v2_runner()" in line]
    assert len(guard) == 1
    compile(v2, VllmModelRunnerV2.path, "exec")


def test_default_release_for_diff_is_the_newest():
    code, out, err = run_cli("patch", "diff", "vllm-dump", "--json", "--exit-code")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["version"] == FULL_CYCLE[-1]
    assert {f["path"] for f in doc["summary"]["files"]} == {
        "vllm/v1/worker/rl_msprobe_dump.py",
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/v1/worker/gpu/model_runner.py",
    }
    assert doc["summary"]["removed"] == 0


def test_fetched_release_is_sources_only():
    root = fetch_release("vllm", FULL_CYCLE[-1])
    assert not list(root.rglob("*.so")), "the sdist's sources, not a platform wheel"
    code, out, _ = run_cli(
        "patch", "status", "vllm-dump", "--tree", f"release:vllm=={FULL_CYCLE[-1]}", "--json"
    )
    assert code == 1 and json.loads(out)["sets"][0]["status"] == "absent"

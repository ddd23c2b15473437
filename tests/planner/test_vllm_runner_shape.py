"""`prepare` and `check` read the model runners of the vLLM that runs (issue 33, items 1 and 3).

Real releases from the package index: vLLM 0.34.0 (V2 runner only; it refuses
VLLM_USE_V2_MODEL_RUNNER=0 at start-up) and 0.33.0 (V1 and V2). A derived script holds only
settings that vLLM accepts, passes `check`, and a tree with no runner vllm-dump knows is refused
(exit 1, nothing written).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl_msprobe.patches.vllm import runner_shape
from rl_msprobe.upstream.release_cache import fetch_release
from tests.support.trees import run_cli

from .conftest import CORPUS

pytestmark = pytest.mark.release

V1 = "vllm/v1/worker/gpu_model_runner.py"
V2 = "vllm/v1/worker/gpu/model_runner.py"
SOURCE = CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh"


def _script(tmp_path: Path, export: str = "") -> Path:
    script = tmp_path / "run_job.sh"
    text = SOURCE.read_text()
    script.write_text(text.replace("set -x\n", f"set -x\n{export}", 1) if export else text)
    assert not export or export in script.read_text()
    return script


def _prepare(script: Path, mode: str, *trees: str) -> tuple[int, dict, str]:
    args = [a for t in trees for a in ("--tree", t)]
    code, out, err = run_cli(
        "prepare", str(script), "--mode", mode, *args, "--tree", "release:verl==0.9.1", "--json"
    )
    return code, json.loads(out) if out.strip() else {}, err


def test_the_shape_of_each_release() -> None:
    newest = runner_shape(fetch_release("vllm", "0.34.0"), "0.34.0")
    assert newest.dumped == (V2,) and not newest.has_v1
    assert newest.skipped == (f"{V1} is not in this tree",)
    both = runner_shape(fetch_release("vllm", "0.33.0"), "0.33.0")
    assert both.dumped == (V1, V2) and both.has_v1 and both.skipped == ()


@pytest.mark.parametrize("mode", ["inference", "consistency"])
def test_prepare_against_0_34_writes_no_runner_setting_and_passes_check(tmp_path: Path, mode: str) -> None:
    script = _script(tmp_path)
    code, doc, err = _prepare(script, mode, "release:vllm==0.34.0")
    assert code == 0, (err, doc.get("violations"))
    assert "vllm-dump" in doc["patch_sets"] and doc["written"]
    derived = Path(doc["script"]).read_text()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in derived
    assert f"vLLM 0.34.0: vllm-dump is wired into {V2}." in doc["notes"]
    code, out, err = run_cli(
        "check",
        doc["script"],
        "--mode",
        mode,
        "--tree",
        "release:vllm==0.34.0",
        "--tree",
        "release:verl==0.9.1",
    )
    assert code == 0, out + err


def test_a_script_that_asks_for_the_v1_runner_gets_what_0_34_accepts(tmp_path: Path) -> None:
    script = _script(tmp_path, "export VLLM_USE_V2_MODEL_RUNNER=0\n")
    code, out, _ = run_cli(
        "check", str(script), "--mode", "inference", "--tree", "release:vllm==0.34.0", "--json"
    )
    rules = {v["rule"]: v for v in json.loads(out)["violations"]}
    assert code == 1 and "inference.vllm_runner_setting" in rules
    assert rules["inference.vllm_runner_setting"]["found"] == "0"
    code, doc, err = _prepare(script, "inference", "release:vllm==0.34.0")
    assert code == 0, (err, doc.get("violations"))
    lines = Path(doc["script"]).read_text().splitlines()
    assert [x for x in lines if x.startswith("export VLLM_USE_V2_MODEL_RUNNER")] == [
        "export VLLM_USE_V2_MODEL_RUNNER=1"
    ]
    (change,) = [c for c in doc["changes"] if c["rule"] == "inference.vllm_runner_setting"]
    assert (change["found"], change["required"]) == ("0", "1") and "refuses" in change["why"]
    # vLLM 0.33.0 has the V1 runner (patched too): the script's choice stands
    code, doc, err = _prepare(script, "inference", "release:vllm==0.33.0")
    assert code == 0, err
    assert "export VLLM_USE_V2_MODEL_RUNNER=0" in Path(doc["script"]).read_text()
    assert not [c for c in doc["changes"] if c["key"] == "VLLM_USE_V2_MODEL_RUNNER"]


@pytest.mark.parametrize("mode", ["inference", "consistency"])
def test_a_tree_without_a_dump_path_is_refused(tmp_path: Path, mode: str) -> None:
    """A vLLM whose V2 runner moved its eager forward out of execute_model (a shape this rl-msprobe
    does not know), and no V1 runner: no derived script, exit 1, the reason named."""
    tree = tmp_path / "vllm-tree"
    shutil.copytree(fetch_release("vllm", "0.34.0"), tree)
    runner = tree / V2
    runner.write_text(runner.read_text().replace("self.model(**model_inputs)", "self._eager(model_inputs)"))
    script = _script(tmp_path)
    code, doc, err = _prepare(script, mode, str(tree))
    assert code == 1, err
    assert doc["written"] is False and doc["script"] is None
    (violation,) = [v for v in doc["violations"] if v["rule"] == "inference.vllm_dump_path"]
    assert f"{V1} is not in this tree" in violation["found"]
    assert "eager model forward in execute_model" in violation["found"]
    assert "no rollout dump path exists" in violation["fix"]
    assert not list(tmp_path.glob("run_*_job.sh")) and not list(tmp_path.glob("msprobe_*"))

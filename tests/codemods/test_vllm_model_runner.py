"""Before/after fixtures and properties of the upstream-vLLM codemods, and the vllm-dump set."""

from __future__ import annotations

import json

import pytest

from rl_msprobe.codemods.base import AnchorError, Status
from rl_msprobe.codemods.vllm_model_runner import VllmModelRunner
from rl_msprobe.codemods.vllm_model_runner_v2 import LEGACY_MARKER, VllmModelRunnerV2
from rl_msprobe.errors import UserError
from rl_msprobe.patches import get_set
from tests.support.codemod_cases import (
    FIXTURES,
    invalid,
)
from tests.support.trees import run_cli


def test_every_variant_has_invalid_cases():
    assert len(invalid("vllm-model-runner")) >= 2 and len(invalid("vllm-v2-model-runner")) >= 2


def _lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.parametrize("variant", ["v0240", "v0300"])
def test_where_the_lines_go(variant):
    """The decorator is outermost on execute_model; start is right before the forward statement,
    inside the forward `with`; init is the last statement of __init__; _dummy_run is untouched."""
    before = (FIXTURES / "vllm-model-runner" / f"{variant}.before.py").read_text()
    lines = _lines(VllmModelRunner().apply(before))
    deco = next(i for i, line in enumerate(lines) if "@rl_msprobe_dump.dump_step" in line)
    assert lines[deco + 1].strip() == "@torch.inference_mode()"
    assert lines[deco + 2].strip() == "def execute_model("
    start = next(i for i, line in enumerate(lines) if "start_forward(self)" in line)
    assert lines[start + 1].strip() == "model_output = self._model_forward("
    assert lines[start - 1].strip() == "):", "inside the forward `with`, after its context managers"
    assert lines[start].index("rl_msprobe_dump") == lines[start + 1].index("model_output")
    init = next(i for i, line in enumerate(lines) if "init_runner(self)" in line)
    assert lines[init - 1].strip() == "self.layerwise_nvtx_hooks_registered = False"
    assert lines[init + 2].strip().startswith("def _model_forward")
    dummy = "\n".join(lines).split("def _dummy_run")[-1] if "_dummy_run" in before else ""
    assert "rl-msprobe" not in dummy


def test_only_the_top_level_runner_class_is_patched():
    source = (FIXTURES / "vllm-model-runner" / "v0240.before.py").read_text()
    source += (
        "\n\nclass XPUModelRunner(GPUModelRunner):\n"
        "    def __init__(self, vllm_config):\n"
        "        super().__init__(vllm_config)\n\n"
        "    def execute_model(self, scheduler_output):\n"
        "        return self._model_forward(scheduler_output)\n"
    )
    out = VllmModelRunner().apply(source)
    assert "rl-msprobe" not in out.split("class XPUModelRunner")[1]
    assert out.count("# rl-msprobe:vllm-model-runner") == 4


def test_moved_forward_after_apply_is_a_conflict():
    codemod = VllmModelRunner()
    before = (FIXTURES / "vllm-model-runner" / "v0300.before.py").read_text()
    applied = codemod.apply(before)
    drifted = applied.replace("self._model_forward(\n", "self._run_the_model(\n")
    assert codemod.status(drifted).status is Status.CONFLICT
    with pytest.raises(AnchorError, match="model forward in execute_model"):
        codemod.apply(codemod.revert(drifted), version="0.34.0")


def test_set_patches_both_runners_and_says_how_to_enable():
    patch_set = get_set("vllm-dump")
    assert patch_set.project == "vllm" and (patch_set.min_version, patch_set.max_version) == (
        "0.24.0",
        "0.34.0",
    )
    text = " ".join(patch_set.notes) + patch_set.description
    assert "MSPROBE_ROLLOUT_CONFIG" in text and "enforce_eager=True" in text
    assert "VLLM_USE_V2_MODEL_RUNNER=0" not in patch_set.description  # no runner setting is needed
    labels = {p.label: p for p in patch_set.all_pieces()}
    assert set(labels) == {"vllm-dump-file", "vllm-records-file", "vllm-model-runner", "vllm-v2-model-runner"}
    # the tree's code decides which runner is patched: neither runner piece is required alone ...
    assert not labels["vllm-model-runner"].essential and not labels["vllm-v2-model-runner"].essential
    # ... but the dump needs one of them
    (capability,) = patch_set.all_capabilities()
    assert set(capability.pieces) == {"vllm-model-runner", "vllm-v2-model-runner"}
    helper = labels["vllm-dump-file"].item.content().decode()
    assert "Added to this tree by rl-msprobe" in helper[:300]
    bare = helper.replace("rl_msprobe_dump", "").replace("rl_msprobe_records", "")
    assert "rl_msprobe" not in bare, (
        "the helper never imports rl-msprobe (only its sibling files in the tree)"
    )
    records = labels["vllm-records-file"].item
    assert (
        records.path == "vllm/v1/worker/rl_msprobe_records.py"
        and records.source == "common/rl_msprobe_records.py"
    )


def test_patch_list_names_the_set():
    code, out, _ = run_cli("patch", "list", "--json")
    assert code == 0
    (entry,) = [s for s in json.loads(out) if s["name"] == "vllm-dump"]
    assert "V1 and V2" in entry["description"]
    assert {p["path"] for p in entry["pieces"]} == {
        "vllm/v1/worker/rl_msprobe_dump.py",
        "vllm/v1/worker/rl_msprobe_records.py",
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/v1/worker/gpu/model_runner.py",
    }


def test_the_v2_guard_of_an_earlier_rl_msprobe_is_taken_out_by_revert():
    """Trees patched before the V2 dump path hold `# rl-msprobe:vllm-v2-runner-guard` lines: status
    says they differ, apply refuses until a revert, and revert gives back the original bytes."""
    before = (FIXTURES / "vllm-v2-model-runner" / "v0240.before.py").read_text()
    lines = before.splitlines(keepends=True)
    init = next(i for i, line in enumerate(lines) if "def __init__" in line)
    old = [
        *lines[:8],
        f"from vllm.v1.worker import rl_msprobe_dump  {LEGACY_MARKER}\n",
        *lines[8 : init + 1],
        f"        rl_msprobe_dump.refuse_v2_runner()  {LEGACY_MARKER}\n",
        *lines[init + 1 :],
    ]
    guarded = "".join(old)
    codemod = VllmModelRunnerV2()
    assert codemod.status(guarded).status is Status.CONFLICT
    with pytest.raises(UserError, match="patch revert"):
        codemod.apply(guarded)
    assert codemod.revert(guarded) == before
    after = (FIXTURES / "vllm-v2-model-runner" / "v0240.after.py").read_text()
    assert codemod.apply(codemod.revert(guarded)) == after


def _fixture_tree(tmp_path, version="0.30.0", v2=True, v1=True):
    root = tmp_path / "tree"
    worker = root / "vllm" / "v1" / "worker"
    (worker / "gpu").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (worker / "gpu_model_runner.py").write_text(
        (FIXTURES / "vllm-model-runner" / "v0300.before.py").read_text()
    )
    if v2:
        (worker / "gpu" / "model_runner.py").write_text(
            (FIXTURES / "vllm-v2-model-runner" / "v0240.before.py").read_text()
        )
    if not v1:
        (worker / "gpu_model_runner.py").unlink()
    return root


def test_apply_output_and_status_on_a_plain_tree(tmp_path):
    """Outside git: apply patches both runners, status lists every piece, revert is exact."""
    root = _fixture_tree(tmp_path)
    original = {p: p.read_bytes() for p in root.rglob("*.py")}
    code, out, err = run_cli("patch", "apply", "vllm-dump", "--tree", str(root))
    assert code == 0, err
    assert "vllm 0.30.0" in out and "no runner setting is needed" in out
    code, out, _ = run_cli("patch", "status", "vllm-dump", "--tree", str(root))
    assert code == 0 and "vllm-dump: applied" in out
    sites = "vllm/v1/worker/gpu_model_runner.py, vllm/v1/worker/gpu/model_runner.py"
    assert f"capability found: model-step dump ({sites})" in out
    code, _, err = run_cli("patch", "revert", "vllm-dump", "--tree", str(root))
    assert code == 0, err
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == original
    assert not (root / "vllm" / "v1" / "worker" / "rl_msprobe_dump.py").exists()


@pytest.mark.parametrize(
    ("v1", "v2", "patched", "skipped"),
    [
        (True, False, "vllm-model-runner", "vllm-v2-model-runner"),  # before the V2 runner
        (False, True, "vllm-v2-model-runner", "vllm-model-runner"),  # vLLM 0.34: V2 only
    ],
)
def test_the_runner_the_tree_has_is_patched(tmp_path, v1, v2, patched, skipped):
    root = _fixture_tree(tmp_path, v1=v1, v2=v2)
    code, out, err = run_cli("patch", "apply", "vllm-dump", "--tree", str(root), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [s["codemod"] for s in doc["skipped"]] == [skipped]
    assert "is not in this tree" in doc["skipped"][0]["detail"]
    code, out, _ = run_cli("patch", "status", "vllm-dump", "--tree", str(root), "--json")
    assert code == 0
    (entry,) = json.loads(out)["sets"]
    files = {f["codemod"]: f["status"] for f in entry["files"]}
    assert files == {
        "vllm-dump-file": "applied",
        "vllm-records-file": "applied",
        patched: "applied",
        skipped: "not-applicable",
    }
    (capability,) = entry["capabilities"]
    assert capability["found"] and len(capability["sites"]) == 1


def test_a_tree_with_neither_runner_is_refused_naming_both_files(tmp_path):
    root = _fixture_tree(tmp_path, v1=False, v2=False)
    for command in ("diff", "apply", "status"):
        code, out, err = run_cli("patch", command, "vllm-dump", "--tree", str(root))
        assert code == 2, (command, out)
        assert "capability 'model-step dump'" in err and "has no patched site" in err
        assert "vllm/v1/worker/gpu_model_runner.py is not in this tree" in err
        assert "vllm/v1/worker/gpu/model_runner.py is not in this tree" in err
    assert not (root / "vllm" / "v1" / "worker" / "rl_msprobe_dump.py").exists()


@pytest.mark.parametrize(("version", "why"), [("0.23.0", "older than"), ("0.35.0.dev3+g1a2b", "newer than")])
def test_untested_versions_are_patched_with_a_warning_when_the_shape_is_found(tmp_path, version, why):
    root = _fixture_tree(tmp_path, version=version)
    code, out, err = run_cli("patch", "apply", "vllm-dump", "--tree", str(root), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["tested"] is False and why in doc["warnings"][0] and "all anchors found" in doc["warnings"][0]
    code, _, err = run_cli("patch", "diff", "vllm-dump", "--tree", str(root))
    assert code == 0 and f"vllm {version} is {why}" in err


def test_a_runner_without_the_model_forward_is_refused_naming_the_anchor(tmp_path):
    root = _fixture_tree(tmp_path, version="0.34.0")
    runner = root / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    runner.write_text(runner.read_text().replace("self._model_forward(", "self.model("))
    code, _, err = run_cli("patch", "apply", "vllm-dump", "--tree", str(root))
    assert code == 2 and "model forward in execute_model" in err and "_model_forward" in err
    assert not (root / "vllm" / "v1" / "worker" / "rl_msprobe_dump.py").exists()


def test_forward_inside_nested_blocks_and_a_match_statement():
    source = (
        "import torch\n\n\nclass GPUModelRunner:\n    def __init__(self, c):\n        self.c = c\n\n"
        "    def execute_model(self, scheduler_output):\n"
        "        match scheduler_output:\n            case None:\n                return None\n"
        "        try:\n            if scheduler_output:\n                out = self._model_forward(1)\n"
        "            else:\n                out = self._model_forward(2)\n        finally:\n            pass\n"
        "        return out\n"
    )
    codemod = VllmModelRunner()
    out = codemod.apply(source)
    assert out.count("start_forward(self)") == 2
    assert codemod.revert(out) == source and codemod.apply(out) == out
    compile(out, "runner.py", "exec")

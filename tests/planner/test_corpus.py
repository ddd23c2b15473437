"""The launch-script corpus: expected detect and check results; prepare -> check passes for
every applicable mode; derived scripts are valid bash; the original's bytes never change."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main

from .conftest import EXPECTED

BASH = shutil.which("bash")


def run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def test_corpus_is_big_and_varied() -> None:
    assert len(EXPECTED) >= 12
    detected = [e["detect"] for e in EXPECTED.values()]
    assert {d["rollout"] for d in detected} >= {"vllm", "sglang", "unknown"}
    assert {d["train_backend"] for d in detected} >= {"fsdp", "megatron"}
    assert any(d["fully_async"] for d in detected)


def test_detect_matches_expected(corpus_script: tuple[str, Path, dict]) -> None:
    _, path, expected = corpus_script
    code, doc = run("detect", str(path))
    for key, value in expected["detect"].items():
        assert doc[key] == value, key
    assert code == (1 if expected["detect"]["mode"] == "unknown" else 0)
    assert doc["reasons"]


MODES = ["training", "inference", "consistency", "consistency_batch_one"]


def mode_args(mode: str) -> list[str]:
    """consistency_batch_one: consistency's original plan, behind --batch-one (prepare and check)."""
    if mode == "consistency_batch_one":
        return ["--mode", "consistency", "--batch-one"]
    return ["--mode", mode]


@pytest.mark.parametrize("mode", MODES)
def test_check_matches_expected(corpus_script: tuple[str, Path, dict], mode: str) -> None:
    _, path, expected = corpus_script
    code, doc = run("check", str(path), *mode_args(mode))
    assert sorted({v["rule"] for v in doc["violations"]}) == expected["check"][mode]
    assert code == (0 if not expected["check"][mode] else 1)
    assert doc["ok"] is (code == 0)
    for violation in doc["violations"]:
        assert violation["fix"], violation


@pytest.mark.parametrize("mode", MODES)
def test_prepare_then_check(corpus_script: tuple[str, Path, dict], mode: str, tmp_path: Path) -> None:
    name, path, expected = corpus_script
    before = path.read_bytes()
    out = tmp_path / "out"
    code, doc = run("prepare", str(path), *mode_args(mode), "--out", str(out))
    assert path.read_bytes() == before, "the original must never change"
    if mode not in expected["prepare"]:
        assert code == 1 and doc["written"] is False and doc["violations"]
        assert not out.exists() or not any(out.iterdir())
        return
    assert code == 0, doc["violations"]
    derived = Path(doc["script"])
    assert derived.parent == out and derived.name.startswith(
        {
            "training": "run_profiler_",
            "inference": "run_infer_dump_",
            "consistency": "run_consistency_",
            "consistency_batch_one": "run_consistency_",
        }[mode]
    )
    assert os.access(derived, os.X_OK)
    for role, cfg in doc["configs"].items():
        assert os.path.isabs(cfg) and Path(cfg).is_file(), role
        config = json.loads(Path(cfg).read_text())
        assert config["level"] == "mix"
        assert ("dump_path" in config) is (role != "training")
    if BASH:
        proc = subprocess.run([BASH, "-n", str(derived)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    args, mode = mode_args(mode), mode_args(mode)[1]
    code2, doc2 = run("check", str(derived), "--mode", mode)  # the derived header says --batch-one
    assert code2 == 0 and doc2["ok"], doc2["violations"]
    # the derived script carries its mode's signals: detect finds the mode without a hint
    # (unless the original already carried another mode's signals)
    found = run("detect", str(derived))[1]["mode"]
    if expected["detect"]["mode"] == "unknown":
        assert found == mode
    else:
        assert found in (mode, expected["detect"]["mode"], "unknown")
    # preparing the derived script again changes nothing of substance: it already passes
    code3, doc3 = run("prepare", str(derived), *args, "--out", str(tmp_path / "again"))
    assert code3 == 0, doc3["violations"]


def test_prepare_default_out_is_beside_the_original(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[2] / "fixtures" / "launch" / "run_qwen2_7b_grpo_fsdp_vllm.sh"
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    code, doc = run("prepare", str(path), "--mode", "inference")
    assert code == 0
    assert Path(doc["script"]).parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "msprobe_qwen2_7b_grpo_fsdp_vllm",
        "run_infer_dump_qwen2_7b_grpo_fsdp_vllm.sh",
        "run_qwen2_7b_grpo_fsdp_vllm.sh",
    ]

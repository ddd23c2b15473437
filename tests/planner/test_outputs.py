"""`prepare` never costs the user a byte: it overwrites only what it wrote itself, never the original."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.trees import run_cli

from .conftest import CORPUS

SOURCE = CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh"


def _prepare(script: Path, *extra: str) -> tuple[int, dict | None, str]:
    code, out, err = run_cli("prepare", str(script), "--mode", "training", "--json", *extra)
    return code, (json.loads(out) if out.strip() else None), err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "run_job.sh"
    path.write_bytes(SOURCE.read_bytes())
    return path


def test_second_prepare_rewrites_its_own_files(script: Path) -> None:
    code, doc, err = _prepare(script)
    assert code in (0, 1) and doc and doc["written"], err
    code, doc, err = _prepare(script, "--steps", "3")
    assert code in (0, 1) and doc and doc["written"], err
    assert "global_profiler.steps=[3]" in Path(doc["script"]).read_text()


def test_a_file_in_the_way_is_refused_then_forced(script: Path) -> None:
    derived = script.parent / "run_profiler_job.sh"
    derived.write_text("#!/bin/bash\n# my own script of that name\n")
    before = _files(script.parent)
    code, _, err = _prepare(script)
    assert code == 2 and str(derived) in err and "--force" in err and "Nothing was written" in err
    assert _files(script.parent) == before
    code, doc, err = _prepare(script, "--force")
    assert code in (0, 1) and doc and doc["written"], err
    assert "Derived by rl-msprobe" in derived.read_text()


def test_an_edited_config_is_not_overwritten(tmp_path: Path, script: Path) -> None:
    code, doc, err = _prepare(script, "--mode", "inference")
    assert code in (0, 1) and doc, err
    config = Path(next(iter(doc["configs"].values())))
    config.write_text(config.read_text().replace('"level"', '"level" ', 1))  # the user's edit
    edited = config.read_bytes()
    code, _, err = _prepare(script, "--mode", "inference")
    assert code == 2 and str(config) in err
    assert config.read_bytes() == edited


def test_derived_path_reached_through_a_symlink_is_the_original(tmp_path: Path) -> None:
    real = tmp_path / "run_profiler_job.sh"  # the user's real script happens to carry the derived name
    real.write_bytes(SOURCE.read_bytes())
    link = tmp_path / "run_job.sh"
    link.symlink_to(real.name)
    before = _files(tmp_path)
    code, _, err = _prepare(link)
    assert code == 2 and "original script" in err and "--out" in err
    assert _files(tmp_path) == before and link.is_symlink()
    code, _, err = _prepare(link, "--force")  # not even with --force
    assert code == 2 and real.read_bytes() == SOURCE.read_bytes()


def test_a_symlink_in_the_way_is_not_followed(tmp_path: Path, script: Path) -> None:
    elsewhere = tmp_path / "notes.txt"
    elsewhere.write_text("mine\n")
    (script.parent / "run_profiler_job.sh").symlink_to(elsewhere)
    code, _, err = _prepare(script)
    assert code == 2 and "run_profiler_job.sh" in err
    code, _, err = _prepare(script, "--force")
    assert code in (0, 1), err
    assert elsewhere.read_text() == "mine\n", "--force replaces the link, never the file it points to"


def test_crlf_script_is_refused_naming_its_line_endings(tmp_path: Path) -> None:
    """bash takes each line's \\r into its last word (the settings never reach verl): refused, nothing written
    (issue 45)."""
    script = tmp_path / "run_job.sh"
    script.write_bytes(SOURCE.read_bytes().replace(b"\n", b"\r\n"))
    code, doc, err = _prepare(script)
    assert code == 2 and not doc, err
    assert f"{script}:1: the script has Windows (CRLF) line endings" in err and "Nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_job.sh"]
    assert script.read_bytes() == SOURCE.read_bytes().replace(b"\n", b"\r\n")


def test_unreadable_script_exit_2(tmp_path: Path, script: Path) -> None:
    # a file whose read fails even for root (EIO): a link to /proc/self/mem
    link = tmp_path / "run_mem.sh"
    link.symlink_to("/proc/self/mem")
    code, _, err = run_cli("prepare", str(link), "--mode", "training")
    assert code == 2 and "cannot be read" in err
    if os.geteuid() != 0:  # root reads any file whatever its mode
        script.chmod(0)
        code, _, err = run_cli("prepare", str(script), "--mode", "training")
        assert code == 2 and "cannot be read" in err


@pytest.mark.parametrize("python", ["python3 'x", "/etc/hostname"])
def test_bad_python_exit_2(script: Path, python: str) -> None:
    code, _, err = run_cli("prepare", str(script), "--mode", "training", "--python", python)
    assert code == 2 and "--python" in err
    assert not (script.parent / "run_profiler_job.sh").exists()


@pytest.mark.parametrize("risk", [None, "FOCUS"])
def test_every_config_says_its_risk_level(script: Path, risk: str | None) -> None:
    """FOCUS unless asked; every config written carries it; the summary and --json say it."""
    extra = ["--risk-level", risk] if risk else []
    code, doc, err = _prepare(script, "--mode", "consistency", "--batch-one", *extra)
    assert code in (0, 1) and doc and doc["written"], err
    expected = risk or "FOCUS"
    assert doc["msprobe"] == {"level": "mix", "task": "statistics", "risk_level": expected}
    assert len(doc["configs"]) == 2
    for path in doc["configs"].values():
        assert json.loads(Path(path).read_text())["risk_level"] == expected
    code, out, err = run_cli("prepare", str(script), "--mode", "consistency", "--batch-one", *extra)
    assert f"risk_level {expected} (" in out, out[-2000:]

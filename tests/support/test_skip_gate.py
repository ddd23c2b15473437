"""The CI skip gate (tests/support/skip_gate.py) on a tiny suite of its own, in a pytest subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = """
import os
import pytest
from tests.support.skip_gate import skip_without_accelerator

def test_runs():
    assert True

def test_npu_only():
    skip_without_accelerator("the NPU dump needs an Ascend device")

@pytest.mark.xfail(reason="not built yet", strict=True)
def test_not_yet():
    assert False

def test_missing_install():
    if os.environ.get("GATE_MISSING_BROWSER"):
        pytest.skip("Chromium is not installed")
"""


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(SUITE)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "RL_MSPROBE_STRICT_SKIPS")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.support.skip_gate",
            "-c",
            os.devnull,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
    )


def test_ci_fails_on_a_skip_that_is_not_hardware_bound(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, GATE_MISSING_BROWSER="1", CI="true")
    assert proc.returncode == 1, proc.stdout
    assert "skips CI does not accept" in proc.stdout
    assert "test_missing_install: Chromium is not installed" in proc.stdout
    assert "test_npu_only" not in proc.stdout.split("skips CI does not accept")[1]


def test_ci_accepts_the_accelerator_skip_and_xfails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, RL_MSPROBE_STRICT_SKIPS="1")
    assert proc.returncode == 0, proc.stdout
    assert "2 passed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout
    assert "skips CI does not accept" not in proc.stdout


def test_outside_ci_the_gate_is_off(monkeypatch) -> None:
    from tests.support import skip_gate

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("RL_MSPROBE_STRICT_SKIPS", raising=False)
    assert not skip_gate.strict()
    monkeypatch.setenv("RL_MSPROBE_STRICT_SKIPS", "1")
    assert skip_gate.strict()

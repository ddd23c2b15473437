"""The two test tiers of tests/support/tiers.py, on a tiny suite of its own in a pytest subprocess:
the default tier deselects (never skips) what is marked ``full``, a ``full`` fixture parameter
included; ``--full`` and ``RL_MSPROBE_FULL=1`` run everything; release parameters keep only the
newest version (and those asked for) in the default tier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiers import newest_in_default

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = 'pytest_plugins = ["tests.support.tiers"]\n'
SUITE = """
import pytest
from tests.support import tiers
from tests.support.tiers import newest_in_default

@pytest.fixture(params=[pytest.param("old", marks=pytest.mark.full), "new"])
def shape(request):
    return request.param

def test_shape(shape):
    open("ran.log", "a").write(f"shape-{shape}\\n")

@pytest.mark.full
def test_only_full():
    assert tiers.full()
    open("ran.log", "a").write("only-full\\n")

def test_both():
    open("ran.log", "a").write(f"both full={tiers.full()}\\n")

@pytest.mark.parametrize("version", newest_in_default(["0.10.0", "0.9.1", "0.2.0"], keep=["0.2.0"]))
def test_release(version):
    open("ran.log", "a").write(f"release-{version}\\n")
"""


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    full: the full tier only\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "ran.log").unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "RL_MSPROBE_FULL"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
    )
    ran = (tmp_path / "ran.log").read_text().splitlines() if (tmp_path / "ran.log").exists() else []
    return proc, sorted(ran)


def test_default_tier_deselects_what_is_marked_full(tmp_path: Path) -> None:
    proc, ran = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ran == ["both full=False", "release-0.10.0", "release-0.2.0", "shape-new"], ran
    assert "3 deselected" in proc.stdout and "skipped" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("how", [("--full",), ()], ids=["option", "environment"])
def test_full_tier_runs_everything(tmp_path: Path, how: tuple[str, ...]) -> None:
    env = {} if how else {"RL_MSPROBE_FULL": "1"}
    proc, ran = _run(tmp_path, *how, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ran == [
        "both full=True",
        "only-full",
        "release-0.10.0",
        "release-0.2.0",
        "release-0.9.1",
        "shape-new",
        "shape-old",
    ], ran
    assert "deselected" not in proc.stdout, proc.stdout


def test_newest_in_default_orders_versions_not_strings_and_reads_tuples() -> None:
    params = newest_in_default([("0.9.1", "a"), ("0.10.0", "b")], version=lambda p: p[0])
    assert params[1] == ("0.10.0", "b")  # 0.10.0 is newer than 0.9.1
    assert params[0].values == ("0.9.1", "a") and params[0].marks[0].name == "full"

"""Build the cached test venvs in the background as soon as the session knows it needs them.

A cold run spends minutes in pip for each cached venv (the job venv, one SGLang venv per code
shape). Built on first use, that time adds to the tests'; started right after collection, in one
background process, it overlaps with the tests that come first. Nothing waits twice: each venv is
built behind its own file lock and stamp (tests/support/venvs.py), so a test that needs a venv
still being built waits on that lock and then finds it ready. The background process goes with
the session (a half-built venv has no stamp and is rebuilt next time).
``RL_MSPROBE_NO_PREBUILD=1`` turns it off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wanted(items: list[pytest.Item]) -> list[list[str]]:
    """The build commands (module + arguments) for the venvs the collected e2e tests use."""
    from tests.support import job_venv, sglang_job_venv, sglang_venv

    e2e = [item for item in items if item.get_closest_marker("e2e")]
    sglang_tests = [item for item in e2e if item.path.name.startswith("test_sglang_")]
    # the GRPO job with an SGLang rollout runs in its own venv (verl + SGLang at verl's pin)
    sglang_job_tests = [item for item in sglang_tests if item.path.name.startswith("test_sglang_rollout")]
    commands = []
    if len(e2e) > len(sglang_tests) and not job_venv.VENV.is_ready():
        commands.append(["tests.support.job_venv", "build"])
    # in the order the tests first need them: the job venv (tests/consistency runs first), then the
    # SGLang engine venvs (tests/live/test_sglang_inference_e2e.py), then the SGLang job venv
    # (tests/live/test_sglang_rollout_e2e.py, after it)
    if sglang_tests and not os.environ.get("RL_MSPROBE_SKIP_SGLANG_E2E"):
        if len(sglang_tests) > len(sglang_job_tests):
            shapes = [shape for shape, venv in sglang_venv.VENVS.items() if not venv.is_ready()]
            if shapes:
                commands.append(["tests.support.sglang_venv", "build", *shapes])
        if sglang_job_tests and not sglang_job_venv.VENV.is_ready():
            commands.append(["tests.support.sglang_job_venv", "build"])
    return commands


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("RL_MSPROBE_NO_PREBUILD") or session.config.option.collectonly:
        return
    commands = _wanted(session.items)
    if not commands:
        return
    log = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rl-msprobe" / "prebuild.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    script = " && ".join(" ".join([sys.executable, "-m", *command]) for command in commands)
    with log.open("w") as out:
        process = subprocess.Popen(
            ["bash", "-c", script], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    session.config.add_cleanup(lambda: _stop(process))


def _stop(process: subprocess.Popen) -> None:
    """The build goes with the session (its venv, unstamped, is rebuilt by the next one)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()

"""Build the cached test venvs in the background as soon as the session knows it needs them,
and run the tests that need none of them first.

A cold run spends minutes in pip for each cached venv (the job venv, one SGLang venv per code
shape). Built on first use, that time adds to the tests'; started right after collection, in one
background process at a low priority (nice 10), it overlaps with the tests that come first.
Nothing waits twice: each venv is built behind its own file lock and stamp (tests/support/venvs.py),
so a test that needs a venv still being built waits on that lock and then finds it ready. The background process goes with
the session (a half-built venv has no stamp and is rebuilt next time). The venvs and their build
order: tests/support/cached_venvs.py.

While a build is due, the modules with no e2e test run first, then the e2e modules in the order
the venvs are built (job venv, SGLang engine venvs, SGLang job venv), so no test waits on a cold
build while venv-free tests are left to run. A module moves whole (its module-scoped fixtures,
e.g. a live job, are set up once); the order inside a module is kept.
``RL_MSPROBE_NO_PREBUILD=1`` turns both off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cached_venvs import JOB_VENV, NO_VENV, SGLANG_JOB_VENV, SGLANG_VENVS, builds

ROOT = Path(__file__).resolve().parents[2]
# the builds yield to the tests: beside a live verl job (2026-12-02, one 1-step job, other sessions'
# load 2-4) a busy core at nice 0 made the job take 322 s against 116-150 s alone, at nice 10 181 s
BACKGROUND = ("nice", "-n", "10")


def _need(item: pytest.Item) -> int:
    """Which cached venv an item needs (e2e tests run real upstream code in one)."""
    if not item.get_closest_marker("e2e"):
        return NO_VENV
    if item.path.name.startswith("test_sglang_rollout"):  # the GRPO job with an SGLang rollout
        return SGLANG_JOB_VENV
    if item.path.name.startswith("test_sglang_"):
        return SGLANG_VENVS
    return JOB_VENV


def _wanted(items: list[pytest.Item]) -> list[list[str]]:
    """The build commands (module + arguments) for the venvs the collected e2e tests use."""
    from tests.support import tiers  # imported late: conftest registers it as a plugin first

    return builds({_need(item) for item in items}, full=tiers.full())


def venv_free_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """ITEMS with whole modules reordered by the latest venv any of their tests needs (stable)."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    ordered = sorted(modules.values(), key=lambda module: max(_need(item) for item in module))
    return [item for module in ordered for item in module]


def _prebuild_off(config: pytest.Config) -> bool:
    return bool(os.environ.get("RL_MSPROBE_NO_PREBUILD")) or bool(config.option.collectonly)


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _prebuild_off(config) and _wanted(items):
        items[:] = venv_free_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _prebuild_off(session.config):
        return
    commands = _wanted(session.items)
    if not commands:
        return
    log = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rl-msprobe" / "prebuild.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    script = " && ".join(" ".join([sys.executable, "-m", *command]) for command in commands)
    with log.open("w") as out:
        process = subprocess.Popen(
            [*BACKGROUND, "bash", "-c", script],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    session.config.add_cleanup(lambda: _stop(process))


def _stop(process: subprocess.Popen) -> None:
    """The build goes with the session (its venv, unstamped, is rebuilt by the next one)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()

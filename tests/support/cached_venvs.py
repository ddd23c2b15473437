"""The cached test venvs, in the order the tests first need them, and their background builds.

tests/support/prebuild.py builds the ones a session's collected tests need, right after
collection; `.ci/run` builds every one the whole suite uses while the test line installs itself:

    python3 -m tests.support.cached_venvs build [--full]   # stdlib only: runs before the test venv exists

The default tier (tests/support/tiers.py) needs the job venv and the newest SGLang shape's engine
venv; ``--full`` builds every one.

Each build runs behind its venv's own file lock and stamp (tests/support/venvs.py), so two
builders (this one and a session's prebuild) never build one venv twice: the second waits on the
lock and finds it ready.
"""

from __future__ import annotations

import os
import subprocess
import sys

# what a test needs, in the order the builds run (and the e2e modules run: prebuild.venv_free_first)
NO_VENV, JOB_VENV, SGLANG_VENVS, SGLANG_JOB_VENV = range(4)
EVERY = frozenset({JOB_VENV, SGLANG_VENVS, SGLANG_JOB_VENV})
DEFAULT_TIER = frozenset({JOB_VENV, SGLANG_VENVS})  # the live verl job, one live SGLang engine
DEFAULT_SGLANG_SHAPES = ("native",)  # the default tier's one SGLang engine (the newest shape)


def builds(needs: set[int] | frozenset[int], full: bool = True) -> list[list[str]]:
    """The build commands (module + arguments) for the venvs NEEDS names that are not ready yet
    (of the SGLang engine venvs, only the default tier's shape unless FULL)."""
    from tests.support import job_venv, sglang_job_venv, sglang_venv

    commands = []
    if JOB_VENV in needs and not job_venv.VENV.is_ready():
        commands.append(["tests.support.job_venv", "build"])
    # then the SGLang engine venvs (tests/live/test_sglang_inference_e2e.py), then the SGLang job
    # venv (tests/live/test_sglang_rollout_e2e.py)
    if not os.environ.get("RL_MSPROBE_SKIP_SGLANG_E2E"):
        if SGLANG_VENVS in needs:
            shapes = [
                shape
                for shape, venv in sglang_venv.VENVS.items()
                if (full or shape in DEFAULT_SGLANG_SHAPES) and not venv.is_ready()
            ]
            if shapes:
                commands.append(["tests.support.sglang_venv", "build", *shapes])
        if SGLANG_JOB_VENV in needs and not sglang_job_venv.VENV.is_ready():
            commands.append(["tests.support.sglang_job_venv", "build"])
    return commands


def build_all(full: bool) -> int:
    """Build every cached venv the tier uses, one after the other; stop at a failure (the tests
    then try again and skip loudly, naming why)."""
    for command in builds(EVERY if full else DEFAULT_TIER, full):
        code = subprocess.run([sys.executable, "-m", *command]).returncode
        if code:
            return code
    return 0


if __name__ == "__main__":
    if sys.argv[1:] not in (["build"], ["build", "--full"]):
        sys.exit("usage: python3 -m tests.support.cached_venvs build [--full]")
    sys.exit(build_all(full=sys.argv[2:] == ["--full"]))

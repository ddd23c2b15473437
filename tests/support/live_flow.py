"""A user's rl-msprobe session on the live verl job, through the real CLI (`python -m rl_msprobe`).

From the plain launch script of tests/support/live_job.py: `env --python`, `detect --hint`,
`prepare --mode M --python`, `patch apply` of exactly the sets `prepare` printed; the caller runs
the derived script unchanged (live_job.run) and checks the dumps; then `patch revert`, and the
venv's verl and vLLM trees must be byte-identical to before (bytecode caches aside).

    with live_flow.session(job, "inference", hint="推理采集") as flow:
        result = live_job.run(job, flow.script)
        code, report = flow.cli_json("dumps", "check", str(flow.dump_root))
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import rl_msprobe
from tests.support import live_job, vllm_cpu

PROJECT_ROOT = Path(rl_msprobe.__file__).resolve().parent.parent
TREES = ("verl", "vllm")  # what the patch sets of every mode touch in the venv


def cli(*args: str, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m rl_msprobe ARGS` in a fresh process, this checkout first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "rl_msprobe", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def cli_json(*args: str, cwd: Path | None = None) -> tuple[int, dict, subprocess.CompletedProcess]:
    proc = cli(*args, "--json", cwd=cwd)
    try:
        return proc.returncode, json.loads(proc.stdout), proc
    except ValueError as exc:
        raise AssertionError(
            f"rl-msprobe {' '.join(args)} --json: no JSON (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        ) from exc


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"`{' '.join(map(str, proc.args[2:]))}` exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@dataclass
class Flow:
    job: live_job.Job
    mode: str
    env: dict  # `env --json`
    detection: dict  # `detect --json`
    prepared: dict  # `prepare --json`
    applied: dict = field(default_factory=dict)  # `patch apply --json` (empty when no set)

    @property
    def script(self) -> Path:
        return Path(self.prepared["script"])

    @property
    def sets(self) -> list[str]:
        return list(self.prepared["patch_sets"])


def digests(python: Path) -> dict[str, dict[str, str]]:
    site = vllm_cpu.site_packages(python)
    return {name: vllm_cpu.tree_digest(site / name) for name in TREES}


@contextlib.contextmanager
def session(job: live_job.Job, mode: str, hint: str, *prepare_args: str):
    """The user's steps up to a derived script and patched trees; reverts and checks on exit.
    Holds the venv's patch lock throughout (then live_job.run takes the live-job lock)."""
    python = str(job.python)
    with vllm_cpu.patch_lock():
        before = digests(job.python)
        code, env, proc = cli_json("env", "--python", python)
        assert code == 0 and env.get("ok", True), describe(proc)
        code, detection, proc = cli_json("detect", str(job.script), "--hint", hint)
        assert code == 0 and detection["mode"] == mode, describe(proc)
        code, prepared, proc = cli_json(
            "prepare", str(job.script), "--mode", mode, "--python", python, *prepare_args
        )
        assert code == 0 and prepared["written"], describe(proc)
        flow = Flow(job, mode, env, detection, prepared)
        applied = False
        try:
            if flow.sets:
                code, flow.applied, proc = cli_json("patch", "apply", *flow.sets, "--python", python)
                assert code == 0, describe(proc)
                applied = True
            yield flow
        finally:
            if applied:
                proc = cli("patch", "revert", *flow.sets, "--python", python)
                assert proc.returncode == 0, describe(proc)
            after = digests(job.python)
            for name in TREES:
                changed = sorted(
                    k
                    for k in before[name].keys() | after[name].keys()
                    if before[name].get(k) != after[name].get(k)
                )
                assert not changed, f"site-packages/{name} differs after `patch revert`: {changed[:20]}"


def check_and_compare(
    dump: Path, python: Path, out: Path
) -> tuple[subprocess.CompletedProcess, dict, subprocess.CompletedProcess]:
    """A consistency run's DUMP root (generate/ and actor/): `dumps check`, then `dumps compare
    --python PY --json` into OUT; the compare document, or {"error": ...} when it wrote none."""
    sides = (str(dump / "generate"), str(dump / "actor"))
    check = cli("dumps", "check", *sides, "--mode", "consistency")
    proc = cli("dumps", "compare", *sides, "--out", str(out), "--python", str(python), "--json")
    try:
        compare = json.loads(proc.stdout)
    except ValueError:
        compare = {"error": describe(proc)}
    return check, compare, proc

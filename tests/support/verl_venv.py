"""A cached CPU test venv that runs verl's real training engines (DOMAIN §7).

Recipe: ``torch==2.13.0`` (the CPU wheel lies on local disk here), verl's runtime needs
(ray, tensordict 0.10.0, omegaconf, transformers 5.10.4, peft, datasets, ...) and the real
msprobe (``mindstudio-probe``) in one resolve, then ``--no-deps`` ``verl==0.9.1`` (its
``verl[cpu]`` extra pins another torch) and ``megatron-core==0.16.1`` (imports on CPU).
Other verl releases are not installed: tests put a patched copy first on ``PYTHONPATH``.
The venv is clean (no system site-packages), built once under
``~/.cache/rl-msprobe/venvs/verl-cpu`` (override: ``RL_MSPROBE_VERL_VENV``) behind a file
lock; a stamp written last records the recipe, and a changed recipe rebuilds it.

    python -m tests.support.verl_venv build     # ahead of time, e.g. in the background
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH = "torch==2.13.0"
VERL = "verl==0.9.1"
MEGATRON = "megatron-core==0.16.1"
MSPROBE = "mindstudio-probe"
DEPS = (
    "packaging",
    "numpy",
    "ray",
    "tensordict==0.10.0",
    "omegaconf",
    "transformers==5.10.4",
    "peft",
    "datasets",
    "pillow",
    "codetiming",
    "orjson",
)
STEPS = (
    ("install", TORCH, *DEPS, MSPROBE),
    ("install", "--no-deps", VERL, MEGATRON),
)
CHECK = (
    "import torch, tensordict, ray, verl, msprobe, megatron.core; print(verl.__version__, torch.__version__)"
)
RECIPE = {"steps": [list(s) for s in STEPS], "check": CHECK, "v": 1}
MIN_FREE_GB = 5  # the venv is ~2.5 GB, plus pip's unpack room

# pip failures that mean "this machine cannot provide it" (skip), not "we broke it" (fail)
UNAVAILABLE = (
    "No matching distribution",
    "Could not find a version",
    "No space left",
    "Connection",
    "Temporary failure in name resolution",
    "Read timed out",
    "HTTPError",
    "ProxyError",
    "Network is unreachable",
)


class VenvUnavailable(RuntimeError):
    """The disk or the package index cannot provide the venv: tests skip with this reason."""


def venv_dir() -> Path:
    if os.environ.get("RL_MSPROBE_VERL_VENV"):
        return Path(os.environ["RL_MSPROBE_VERL_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rl-msprobe" / "venvs" / "verl-cpu"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_of(venv: Path) -> Path:
    return venv / "rl-msprobe-recipe.json"


def is_ready(venv: Path) -> bool:
    try:
        return python_of(venv).exists() and json.loads(stamp_of(venv).read_text()) == RECIPE
    except (OSError, ValueError):
        return False


def _run_logged(cmd: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        started = time.monotonic()
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        fh.write(f"# exit {code} after {time.monotonic() - started:.0f} s\n")
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        message = f"`{' '.join(cmd[2:])}` failed (exit {code}); log: {log}\n{tail}"
        if any(marker in tail for marker in UNAVAILABLE):
            raise VenvUnavailable(message)
        raise RuntimeError(message)


def _build_locked(venv: Path, log: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a half-built venv (no stamp) is rebuilt
    log.write_text(f"building {venv} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n{json.dumps(RECIPE)}\n")
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        py = str(python_of(venv))
        for step in STEPS:
            _run_logged([py, "-m", "pip", "--disable-pip-version-check", *step], log)
        _run_logged([py, "-c", CHECK], log)
        stamp_of(venv).write_text(json.dumps(RECIPE))  # written last: marks the venv complete
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    with log.open("a") as fh:
        fh.write(f"\nready in {time.monotonic() - started:.0f} s\n")


def build(venv: Path | None = None) -> Path:
    """Build (or reuse) the venv and return its python. Raises VenvUnavailable when the disk or
    the package index cannot provide it, RuntimeError for any other failure."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return python_of(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(venv.parent).free / 2**30
    if free < MIN_FREE_GB:
        raise VenvUnavailable(
            f"only {free:.1f} GiB free under {venv.parent}; the verl venv needs {MIN_FREE_GB} GiB"
        )
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not is_ready(venv):
            _build_locked(venv, venv.parent / f"{venv.name}.build.log")
    return python_of(venv)


def venv_python_or_skip() -> Path:
    """The venv's python, built if needed; pytest.skip with a loud reason when this machine cannot
    provide it. RL_MSPROBE_SKIP_VERL_E2E=1 skips on purpose."""
    import pytest

    if os.environ.get("RL_MSPROBE_SKIP_VERL_E2E"):
        pytest.skip(
            "SKIPPED ON PURPOSE: RL_MSPROBE_SKIP_VERL_E2E is set (real verl engine runs not attempted)"
        )
    try:
        return build()
    except VenvUnavailable as exc:
        pytest.skip(f"REAL verl ENGINE RUNS NOT DONE: the verl CPU test venv could not be built here: {exc}")


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
    else:
        sys.exit("usage: python -m tests.support.verl_venv build")

"""Cached test venvs for the end-to-end tests that run real upstream code (verl, vLLM).

A venv is built once under ``~/.cache/rl-msprobe/venvs/NAME`` (an environment variable
overrides the path) behind a file lock, checked by importing what it must import, and only
then stamped with its recipe: a half-built venv or a changed recipe is rebuilt. When the
disk or the package index cannot provide it, tests skip with a loud reason — never pass.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# pip failures that mean "this machine cannot provide it" (skip) rather than "we broke it" (fail)
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


def free_gb(path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 2**30


def run_pip(python: Path, *args: str, log: Path) -> None:
    """`python -m pip ARGS`, output appended to `log`; VenvUnavailable when the index or disk says no."""
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        offset = fh.tell()
        started = time.monotonic()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
        fh.write(f"# exit {proc.returncode} after {time.monotonic() - started:.0f} s\n")
    if proc.returncode != 0:
        with log.open("rb") as fh:
            fh.seek(offset)
            own = fh.read().decode(errors="replace")  # this command's output only
        message = f"`pip {' '.join(args)}` failed (exit {proc.returncode}); log: {log}\n{own[-3000:]}"
        if any(marker in own for marker in UNAVAILABLE):
            raise VenvUnavailable(message)
        raise RuntimeError(message)


@dataclass(frozen=True)
class CachedVenv:
    name: str  # folder under ~/.cache/rl-msprobe/venvs
    path_var: str  # environment variable that overrides the folder
    skip_var: str  # environment variable that skips the tests on purpose
    skip_label: str  # what the skip message says was not done
    steps: tuple[tuple[str, ...], ...]  # pip argument lists, run in order
    check: str  # python code the finished venv must run
    recipe: dict[str, Any]  # recorded in the stamp; a changed recipe rebuilds
    min_free_gb: float
    # code run after the pip steps and before the check (test-support workarounds for what the
    # index ships broken on this machine); it must be in the recipe too, by name and version
    fixup: Callable[[Path, Path], None] | None = None  # (python, build log)

    def venv_dir(self) -> Path:
        if os.environ.get(self.path_var):
            return Path(os.environ[self.path_var])
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        return cache / "rl-msprobe" / "venvs" / self.name

    @staticmethod
    def python_of(venv: Path) -> Path:
        return venv / "bin" / "python"

    @staticmethod
    def stamp_of(venv: Path) -> Path:
        return venv / "rl-msprobe-recipe.json"

    def is_ready(self, venv: Path | None = None) -> bool:
        venv = venv or self.venv_dir()
        try:
            return (
                self.python_of(venv).exists() and json.loads(self.stamp_of(venv).read_text()) == self.recipe
            )
        except (OSError, ValueError):
            return False

    def build(self, venv: Path | None = None, free_of: Callable[[Path], float] = free_gb) -> Path:
        """Build (or reuse) the venv and return its python. VenvUnavailable when the disk or the
        index cannot provide it, RuntimeError for any other failure."""
        venv = venv or self.venv_dir()
        if self.is_ready(venv):
            return self.python_of(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        with (venv.parent / f"{venv.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
            if not self.is_ready(venv):
                # the free space is read once the lock is held: a build in progress elsewhere
                # (a background prebuild) must not make a waiting test skip for want of disk
                free = free_of(venv.parent)
                if free < self.min_free_gb:
                    raise VenvUnavailable(
                        f"only {free:.1f} GiB free under {venv.parent}; "
                        f"the {self.name} venv needs {self.min_free_gb} GiB"
                    )
                self._build_locked(venv, venv.parent / f"{venv.name}.build.log")
        return self.python_of(venv)

    def _build_locked(self, venv: Path, log: Path) -> None:
        shutil.rmtree(venv, ignore_errors=True)  # a half-built venv (no stamp) is rebuilt
        log.write_text(
            f"building {venv} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n{json.dumps(self.recipe)}\n"
        )
        started = time.monotonic()
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            python = self.python_of(venv)
            for step in self.steps:
                run_pip(python, *step, log=log)
            if self.fixup is not None:
                self.fixup(python, log)
            check = subprocess.run([str(python), "-c", self.check], capture_output=True, text=True)
            if check.returncode != 0:
                raise RuntimeError(f"the new {self.name} venv does not import: {check.stderr[-3000:]}")
            self.stamp_of(venv).write_text(json.dumps(self.recipe))  # written last: marks it complete
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        with log.open("a") as fh:
            fh.write(f"\nready in {time.monotonic() - started:.0f} s\n")

    def python_or_skip(self, free_of: Callable[[Path], float] = free_gb) -> Path:
        """The venv's python, built if needed; pytest.skip with a loud reason when this machine
        cannot provide it, or when the skip variable is set."""
        import pytest

        if os.environ.get(self.skip_var):
            pytest.skip(f"SKIPPED ON PURPOSE: {self.skip_var} is set ({self.skip_label} not attempted)")
        try:
            return self.build(free_of=free_of)
        except VenvUnavailable as exc:
            pytest.skip(
                f"{self.skip_label} NOT DONE: the {self.name} test venv could not be built here: {exc}"
            )


def main(venv: CachedVenv, module: str) -> None:
    """`python -m tests.support.<module> build`: build ahead of time, e.g. in the background."""
    if sys.argv[1:] == ["build"]:
        print(venv.build())
    else:
        sys.exit(f"usage: python -m tests.support.{module} build")

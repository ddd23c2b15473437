"""The stand-in dumps of tests/dumps/standin.py (a tiny Qwen2 on both sides under real msprobe),
built once per test session for every test that reads them (tests/dumps/test_e2e_dumps.py, the
docs' consistency quickstart): six runs in parallel, tensor and statistics task, the training
side once as it is and once with layer PERTURBED_LAYER perturbed."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STANDIN = Path(__file__).resolve().parents[1] / "dumps" / "standin.py"
PERTURBED_LAYER = 1


def _runs(base: Path) -> dict[str, list[str]]:
    perturb = ["--perturb", str(PERTURBED_LAYER)]
    return {
        "rollout": ["rollout", str(base / "gen")],  # dumps in {gen}/{pid}/step{N}/...
        "train": ["train", str(base / "actor")],  # the helper: {actor}/step{N}/..., log in {actor}/{pid}/
        "train_perturbed": ["train", str(base / "actor_perturbed"), *perturb],
        # msprobe's default task: statistics (no cosine; its statistics checkers)
        "rollout_stats": ["rollout", str(base / "gen_stats")],
        "train_stats": ["train", str(base / "actor_stats")],
        "train_stats_perturbed": ["train", str(base / "actor_stats_perturbed"), *perturb],
    }


@functools.cache
def build() -> dict[str, Path]:
    """{run name: its dump folder} and "base": a folder of this session (removed at exit) that
    the readers may write their outputs into; the dump folders are theirs to read only."""
    base = Path(tempfile.mkdtemp(prefix="rl-msprobe-standin-"))
    atexit.register(shutil.rmtree, base, True)
    runs = _runs(base)
    procs = {
        k: subprocess.Popen(
            [sys.executable, str(STANDIN), *a],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=base,
            env={**os.environ, "STANDIN_TASK": "statistics" if "stats" in k else "tensor"},
        )
        for k, a in runs.items()
    }
    for k, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{k} stand-in failed:\n{out.decode(errors='replace')[-3000:]}"
    return {k: Path(a[1]) for k, a in runs.items()} | {"base": base}

"""Patch engine cost as ratios against baselines measured in the same run.

1. `patch status` and `patch diff` for verl-engine on verl 0.9.1 (library calls, warm) against
   the floor: parsing and regenerating the same files with bare LibCST.
2. `rl-msprobe patch status verl-engine --tree T` as a fresh process (what a user waits for) against
   a fresh process that imports LibCST and parses + regenerates the same files; with
   `--before DIR` (an older rl_msprobe's parent folder) that version's status runs in the same
   rounds, paired, so load drifts hit both alike.
3. `rl-msprobe --help` (a fresh process) against `python -c "import click"`, and proof that
   it imports neither libcst nor git.

Run: python benchmarks/bench_patch.py [--repeat N] [--before DIR]

2026-12-04, 2 cores shared with four other sessions (load average 10.1), median of 7 paired rounds,
before = main 130df06 (`git archive 130df06 rl_msprobe | tar -x -C DIR`):
  fresh-process floor (import libcst, parse + codegen of 2 files): 1544 ms
  status before (every set's codemods and libcst.matchers imported): 2925 ms, 1.89x
  status after (lazy set registry; verl-engine's codemods only, no libcst.matchers): 2024 ms, 1.31x
  (a first run at load 7.7 with `-m` picking the worktree for both sides is discarded: `-P` now)
  again at 18:43 UTC, load 7.1-7.7, all of branch reg in: floor 915 ms, before 1739 ms (1.90x),
  after 1196 ms (1.31x); warm library status 1.26x, diff 1.27x of the warm floor
The lazy registry and a matcher-free Megatron anchor took `libcst.matchers` (0.6 s of the import)
out of verl-engine's status.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import libcst as cst

from rl_msprobe import engine
from rl_msprobe.patches import get_set
from rl_msprobe.upstream.trees import resolve_tree

TREE = "release:verl==0.9.1"


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def process_time(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_processes(runs: dict[str, tuple[list[str], dict[str, str]]], repeat: int) -> dict[str, float]:
    """Median wall time of each command, the commands run one after another in every round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, (argv, env) in runs.items():
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, env={**os.environ, **env})
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(found) for name, found in times.items()}


def process_status(files: list[Path], before: str | None, repeat: int) -> None:
    here = str(Path(__file__).resolve().parents[1])
    floor = f"import libcst\nfor f in {[str(f) for f in files]!r}:\n    libcst.parse_module(open(f).read()).code\n"
    status = [sys.executable, "-P", "-m", "rl_msprobe", "patch", "status", "verl-engine", "--tree", TREE]
    runs = {"floor": ([sys.executable, "-c", floor], {}), "after": (status, {"PYTHONPATH": here})}
    if before:
        runs["before"] = (status, {"PYTHONPATH": before})
    found = paired_processes(runs, repeat)
    print(f"fresh process: floor (import libcst, parse + codegen): {found['floor'] * 1000:.0f} ms")
    for name in ("before", "after"):
        if name in found:
            ratio = found[name] / found["floor"]
            print(
                f"fresh process: patch status verl-engine ({name}): {found[name] * 1000:.0f} ms  ratio {ratio:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--before", help="folder holding an older rl_msprobe package, run in the same rounds")
    args = parser.parse_args()

    target = resolve_tree(TREE, "verl")
    sets = [get_set("verl-engine")]
    files = [target.root / p.path for p in sets[0].all_pieces() if p.path.endswith("transformer_impl.py")]
    sources = [f.read_text() for f in files]

    def floor() -> None:
        for source in sources:
            cst.parse_module(source).code  # noqa: B018

    def status() -> None:
        engine.status(target, sets)

    def diff() -> None:
        engine.diff(engine.plan_apply(target, sets))

    floor(), status(), diff()  # warm imports and caches
    t_floor = best_of(floor, args.repeat)
    t_status = best_of(status, args.repeat)
    t_diff = best_of(diff, args.repeat)
    print(f"floor (bare LibCST parse + codegen of {len(files)} files): {t_floor * 1000:.0f} ms")
    print(f"patch status verl-engine (0.9.1): {t_status * 1000:.0f} ms  ratio {t_status / t_floor:.2f}x")
    print(f"patch diff   verl-engine (0.9.1): {t_diff * 1000:.0f} ms  ratio {t_diff / t_floor:.2f}x")

    process_status(files, args.before, args.repeat)

    probe = (
        "import sys\nfrom rl_msprobe.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('libcst', 'git') if m in sys.modules]\nassert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
    t_click = process_time([sys.executable, "-c", "import click"], args.repeat * 2)
    t_help = process_time([sys.executable, "-m", "rl_msprobe", "--help"], args.repeat * 2)
    print("rl-msprobe --help imports neither libcst nor git")
    print(f"python -c 'import click': {t_click * 1000:.0f} ms")
    print(f"rl-msprobe --help:        {t_help * 1000:.0f} ms  ratio {t_help / t_click:.2f}x")


if __name__ == "__main__":
    main()

"""Patch engine cost as ratios against baselines measured in the same run.

1. `patch status` and `patch diff` for verl-engine on verl 0.9.1 (library calls, warm) against
   the floor: parsing and regenerating the same files with bare LibCST.
2. `rl-msprobe --help` (a fresh process) against `python -c "import click"`, and proof that
   it imports neither libcst nor git.

Run: python benchmarks/bench_patch.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import libcst as cst

from rl_msprobe import engine
from rl_msprobe.patches import get_set
from rl_msprobe.upstream.trees import resolve_tree


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    target = resolve_tree("release:verl==0.9.1", "verl")
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

"""`dumps compare` cost against its floor, measured in the same run (issue 14).

The floor for N pairs is one msprobe import plus N times the in-process work of one pair:
`import msprobe.msprobe, msprobe.pytorch.compare.pt_compare` (what a compare imports, torch
included) timed in a fresh interpreter, and the compare of one pair timed inside a long-lived
msprobe worker (median over repeats, after a warm-up pair). `dumps compare` then runs
over N = 1, 10, 50 copies of that real pair, as a whole command (`python -m rl_msprobe ...`):

- `-j 1`: aim total <= 1.3 x floor(N);
- `-j 2`: aim close to half the per-pair part: total / (import + N x pair / 2);
- the former path, one msprobe process per pair (`--per-process`), for the same N, side by side.

The pair is real: the stand-in rollout and training processes of tests/dumps/standin.py write
msprobe statistics dumps at level mix (what `prepare` writes by default) of a tiny Qwen2.

Measured 2026-11-30 on the shared 2-core machine (load average 16 -> 6 during the run, so the
floor, taken first, is pessimistic): import 18.85 s, one pair 0.915 s in-process.
  N=1:  -j1 20.8 s (1.05 x floor), -j2 15.5 s, one process per pair 22.8 s
  N=10: -j1 19.2 s (0.69),         -j2 44.3 s, one process per pair 188.0 s (9.8 x the worker)
  N=50: -j1 47.7 s (0.74),         -j2 51.2 s (1.23 x import + N x pair / 2)
An earlier run under heavier load (floor without torch's import, so not comparable as a ratio):
N=10 worker 54.9 s against 300.9 s for one process per pair.

Run: python benchmarks/bench_compare.py [--sizes 1,10,50] [--per-process-sizes 1,10,50] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_msprobe.dumps import inputs  # noqa: E402
from rl_msprobe.dumps.compare import compare_args  # noqa: E402
from rl_msprobe.dumps.runners import WorkerRunner, interpreter  # noqa: E402

STANDIN = ROOT / "tests" / "dumps" / "standin.py"


def real_pair(base: Path) -> tuple[Path, Path]:
    """One prefill of the stand-in vLLM-named rollout and its training micro-batch (mix, statistics)."""
    env = {**os.environ, "STANDIN_TASK": "statistics", "STANDIN_LEVEL": "mix"}
    for side, out in (("rollout", "gen"), ("train", "actor")):
        subprocess.run(
            [sys.executable, str(STANDIN), side, str(base / out)],
            cwd=base,
            env=env,
            check=True,
            capture_output=True,
        )
    rollout = sorted((base / "gen").glob("*/step0/*/dump.json"))[0]
    train = sorted((base / "actor").glob("step0/*/dump.json"))[0]
    return train, rollout


def copies(base: Path, train: Path, rollout: Path, n: int) -> tuple[Path, Path]:
    """N plain pairs: {gen,train}_N/step{i}/rank0/dump.json (hard links of the one pair)."""
    g, t = base / f"gen_{n}", base / f"train_{n}"
    for i in range(n):
        for src, root in ((rollout, g), (train, t)):
            d = root / f"step{i}" / "rank0"
            d.mkdir(parents=True)
            os.link(src, d / "dump.json")
    return g, t


def import_seconds(repeat: int) -> float:
    """What one compare needs imported: msprobe's command module and its PyTorch compare (torch)."""
    code = (
        "import time; t = time.perf_counter(); import msprobe.msprobe, msprobe.pytorch.compare.pt_compare; "
        "print(time.perf_counter() - t)"
    )
    runs = [
        float(
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()[-1]  # msprobe prints a CANN notice first
        )
        for _ in range(repeat)
    ]
    return statistics.median(runs)


def pair_seconds(base: Path, train: Path, rollout: Path, repeat: int) -> float:
    runner = WorkerRunner(interpreter(None), base / "worker.log")
    times = []
    try:
        for i in range(repeat + 1):
            out = base / f"inproc{i}"
            out.mkdir()
            given = inputs.prepare(train, rollout, out / "inputs", "fsdp")  # the copies compare makes
            args = compare_args(given.train, given.rollout, "fsdp", out)
            assert runner.run(args, out / "msprobe.log", 600) == 0, (out / "msprobe.log").read_text()[-2000:]
            if i:  # the first pair warms the worker up
                times.append(runner.pair_seconds or 0.0)
    finally:
        runner.close()
    return statistics.median(times)


def compare_seconds(gen: Path, train: Path, out: Path, jobs: int, per_process: bool = False) -> float:
    cmd = [sys.executable, "-m", "rl_msprobe", "dumps", "compare", str(gen), str(train), "--out", str(out)]
    cmd += ["-j", str(jobs), "--json"] + (["--per-process"] if per_process else [])
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - start
    doc = json.loads(proc.stdout)
    assert doc["consistent"], doc["verdict"]
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,10,50")
    p.add_argument("--per-process-sizes", default="1,10,50")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",") if x]
    old_sizes = [int(x) for x in a.per_process_sizes.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        base = Path(tmp)
        train, rollout = real_pair(base)
        imp = import_seconds(a.repeat)
        pair = pair_seconds(base, train, rollout, a.repeat)
        print(f"floor: msprobe import {imp:.2f} s (median of {a.repeat}), one pair in-process {pair:.3f} s")
        print(
            f"{'N':>4} {'floor s':>8} {'-j1 s':>8} {'ratio':>6} {'-j2 s':>8} {'vs half':>7} {'per-process s':>14} {'old/new':>7}"
        )
        for n in sizes:
            gen, tr = copies(base, train, rollout, n)
            floor = imp + n * pair
            j1 = compare_seconds(gen, tr, base / f"o1_{n}", 1)
            j2 = compare_seconds(gen, tr, base / f"o2_{n}", 2)
            half = imp + n * pair / 2
            old = compare_seconds(gen, tr, base / f"op_{n}", 1, per_process=True) if n in old_sizes else None
            print(
                f"{n:>4} {floor:>8.2f} {j1:>8.2f} {j1 / floor:>6.2f} {j2:>8.2f} {j2 / half:>7.2f} "
                + (f"{old:>14.2f} {old / j1:>7.1f}" if old is not None else f"{'-':>14} {'-':>7}")
            )
        print(
            "aim: ratio <= 1.3 (whole command, its own start and the report included); -j2 'vs half' near 1"
        )


if __name__ == "__main__":
    main()

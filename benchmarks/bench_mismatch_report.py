"""`mismatch report` reading cost as ratios against a baseline measured in the same run.

1. Time: `read_triage` (the streaming pass behind `rl-msprobe mismatch report`: per-step,
   per-position, per-token sums, histograms and the worst requests) over a generated triage
   log of N lines (default 1,000,000), against the floor: reading the same file line by line
   with `json.loads` and nothing else. Aim: at most 1.5x.
2. Memory: peak traced memory (tracemalloc, each in a fresh process) of the same pass at N/10
   and N lines with the same steps, vocabulary and response lengths. Flat: ~1x. With --scaled,
   N lines over 10x the steps show what does grow: one entry per step.

The lines are in the real helper's format (`rl-msprobe-triage/1`: prompt and response ids,
9-digit log-probs, a mask on some lines, the three arrays last; the first 100 are checked against
the helper's own writer), with response lengths 8–56 tokens (mean 32) so a million lines fit in
about 1 GB. The report reads the arrays of such lines with numpy (`stream.split_tail`) and the
rest of the line with json; the floor parses all of it with json.

Run: python benchmarks/bench_mismatch_report.py [--lines N] [--steps S] [--repeat K] [--scaled]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PID = 4242
VOCAB = 32_000


def generate(root: Path, lines: int, steps: int, seed: int = 0) -> Path:
    """Write {root}/{pid}/triage.jsonl with `lines` requests spread over `steps` steps, in the helper's
    own line format (the first lines are checked against the helper's writer)."""
    rnd = random.Random(seed)
    folder = root / str(PID)
    folder.mkdir(parents=True)
    per_step = max(1, lines // steps)
    helper = _helper()
    with open(folder / "triage.jsonl", "w") as f:
        for i in range(lines):
            step = 1 + min(steps - 1, i // per_step)
            n = rnd.randint(8, 56)
            rollout = [-rnd.expovariate(1.5) for _ in range(n)]
            noise = 0.002 * (5 if step > steps // 2 else 1)
            train = [r + rnd.gauss(0.0, noise) for r in rollout]
            prompt = [rnd.randrange(VOCAB) for _ in range(12)]
            response = [rnd.randrange(VOCAB) for _ in range(n)]
            mask = [1] * (n - 1) + [1] if i % 17 == 0 else None
            line = (
                f'{{"schema": "rl-msprobe-triage/1", "step": {step}, "index": {i % per_step}, '
                f'"request_id": "{i:032x}", "uid": "u{i // 4}", "prompt_len": 12, '
                + (f'"mask": {json.dumps(mask)}, ' if mask else "")
                + f'"prompt_ids": {json.dumps(prompt)}, '
                f'"response_ids": {json.dumps(response)}, '
                f'"rollout_log_probs": [{",".join(f"{v:.9g}" for v in rollout)}], '
                f'"train_log_probs": [{",".join(f"{v:.9g}" for v in train)}]}}'
            )
            if i < 100:  # the helper itself writes exactly this
                doc = {
                    "schema": "rl-msprobe-triage/1",
                    "step": step,
                    "index": i % per_step,
                    "request_id": f"{i:032x}",
                    "uid": f"u{i // 4}",
                    "prompt_len": 12,
                    **({"mask": mask} if mask else {}),
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "rollout_log_probs": helper._Floats(rollout),
                    "train_log_probs": helper._Floats(train),
                }
                assert helper._dumps(doc) == line, (helper._dumps(doc), line)
            f.write(line + "\n")
    return root


def _helper():
    """The helper module verl-triage adds to verl (its line writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.added_files import load

    return load("verl/verl/utils/rl_msprobe_triage.py", "rl_msprobe_triage_bench")


def baseline(root: Path) -> int:
    """The floor: every line through json.loads, nothing else."""
    n = 0
    loads = json.loads
    with open(root / str(PID) / "triage.jsonl", "rb") as f:
        for line in f:
            loads(line)
            n += 1
    return n


def ours(root: Path) -> int:
    from rl_msprobe.triage.stream import read_triage

    return read_triage(root).requests


def timed(fn) -> float:
    """CPU seconds of one run (this process; less swayed by other work on a shared machine than
    wall time); the baseline and ours alternate, so a ratio is taken under the same load."""
    start = time.process_time()
    fn()
    return time.process_time() - start


_PEAK = """
import sys, tracemalloc
from pathlib import Path
from rl_msprobe.triage.stream import read_triage
import numpy  # imports before tracing
tracemalloc.start()
r = read_triage(Path(sys.argv[1]))
print(tracemalloc.get_traced_memory()[1], r.requests, len(r.steps))
"""


def peak(root: Path) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(root)], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scaled", action="store_true", help="also N lines over 10x the steps (what grows)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_mismatch_") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        full = generate(tmp / "full", a.lines, a.steps)
        size = (full / str(PID) / "triage.jsonl").stat().st_size
        print(
            f"generated {a.lines:,} lines ({size / 2**20:.0f} MiB), {a.steps} steps in {time.perf_counter() - t0:.1f}s"
        )
        assert ours(full) == a.lines, "every line should be read"
        pairs = [(timed(lambda: baseline(full)), timed(lambda: ours(full))) for _ in range(a.repeat)]
        ratios = sorted(o / b for b, o in pairs)
        print(
            f"cpu time  json.loads only {min(b for b, _ in pairs):.2f}s   read_triage {min(o for _, o in pairs):.2f}s   "
            f"ratio per pair {', '.join(f'{r:.2f}' for r in ratios)} -> median {ratios[len(ratios) // 2]:.2f}x "
            "(aim <= 1.5x)"
        )
        short = generate(tmp / "short", a.lines // 10, a.steps)
        p_short, p_long = peak(short), peak(full)
        print(
            f"peak  {a.steps} steps: {a.lines // 10:,} lines {p_short[0] / 2**20:.2f} MiB, "
            f"{a.lines:,} lines {p_long[0] / 2**20:.2f} MiB   ratio {p_long[0] / p_short[0]:.2f}x (flat: ~1x)"
        )
        if not a.scaled:
            return
        subprocess.run(["rm", "-rf", str(full)], check=True)  # free the disk before the scaled run
        q_short, q_long = p_short, peak(generate(tmp / "long_scaled", a.lines, a.steps * 10))
        per_step = (q_long[0] - q_short[0]) / max(1, q_long[2] - q_short[2])
        print(
            f"peak  steps scaled with length ({q_short[2]} -> {q_long[2]} steps): {q_short[0] / 2**20:.2f} -> "
            f"{q_long[0] / 2**20:.2f} MiB, ~{per_step / 1024:.1f} KiB per extra step (two histograms + its worst request)"
        )


if __name__ == "__main__":
    main()

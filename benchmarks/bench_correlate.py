"""`dumps correlate` cost as ratios against a baseline measured in the same run.

1. Time: correlate over a generated dispatch log of N lines (default 1,000,000) plus the
   matching training log, against the floor: reading the same two files line by line with
   `json.loads` and nothing else. Aim: at most 1.5x.
2. Memory: peak traced memory (tracemalloc, each in a fresh process) of correlate at two log
   lengths (N/10 and N). The generated run has a fixed number of requests, and the extra
   lines are what makes real logs long: decode steps (a batch of running requests each) and
   batched prefills. A second pair of runs scales the requests with the length too, to show
   what does grow: one small entry per request id, never one per line.

The logs look like a consistency run's: every request is prefilled alone once (one dump per
prefill, matched by one training micro-batch), then decoded in steps holding 8 requests;
ids carry vLLM's `-<8 hex>` suffix on the rollout side only.

Run: python benchmarks/bench_correlate.py [--lines N] [--requests R] [--repeat K]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROLLOUT_PID, TRAIN_PID = 4101, 5202
DECODE_BATCH = 8


def generate(root: Path, lines: int, requests: int, dumps: bool) -> tuple[Path, Path]:
    """Write {root}/gen/{pid}/dispatch_log.jsonl (`lines` lines) and the matching training log."""
    gen, actor = root / "gen", root / "actor"
    (gen / str(ROLLOUT_PID)).mkdir(parents=True)
    (actor / str(TRAIN_PID)).mkdir(parents=True)
    ids = [f"{i:032x}" for i in range(requests)]
    prefill_every = max(1, lines // requests)
    dumps_at: list[int] = []
    with open(gen / str(ROLLOUT_PID) / "dispatch_log.jsonl", "w") as f:
        next_req = 0
        for step in range(lines):
            if step % prefill_every == 0 and next_req < requests:
                rid = ids[next_req]
                reqs = [{"request_id": f"{rid}-{next_req % 0xFFFFFFFF:08x}", "type": "new", "tokens": 96}]
                phase = "prefill"
                dumps_at.append(step)
                next_req += 1
            else:
                running = max(1, next_req)
                reqs = [
                    {"request_id": f"{ids[(step + k) % running]}-00c0ffee", "type": "cached", "tokens": 1}
                    for k in range(min(DECODE_BATCH, running))
                ]
                phase = "decode"
            f.write(
                f'{{"source": "dispatch", "timestamp": {1.7e9 + step * 0.01:.2f}, "pid": {ROLLOUT_PID}, '
                f'"rank": 0, "step": {step}, "phase": "{phase}", '
                f'"total_num_scheduled_tokens": {sum(r["tokens"] for r in reqs)}, "requests": {json.dumps(reqs)}}}\n'
            )
    with open(actor / str(TRAIN_PID) / "update_actor_log.jsonl", "w") as f:
        for i, rid in enumerate(ids[: len(dumps_at)]):
            line = {
                "source": "update_actor",
                "timestamp": 1.8e9 + i,
                "pid": TRAIN_PID,
                "rank": 0,
                "step": i,
                "request_ids": [rid],
                "num_requests": 1,
            }
            f.write(json.dumps(line) + "\n")
    if dumps:
        for step in dumps_at:
            d = gen / str(ROLLOUT_PID) / f"step{step}" / "rank0"
            d.mkdir(parents=True)
            (d / "dump.json").write_text("{}")
        for i in range(len(dumps_at)):
            d = actor / str(TRAIN_PID) / f"step{i}" / "rank0"
            d.mkdir(parents=True)
            (d / "dump.json").write_text("{}")
    return gen, actor


def baseline(gen: Path, actor: Path) -> int:
    """The floor: every line of both logs through json.loads, nothing else."""
    n = 0
    loads = json.loads
    for path in (
        gen / str(ROLLOUT_PID) / "dispatch_log.jsonl",
        actor / str(TRAIN_PID) / "update_actor_log.jsonl",
    ):
        with open(path, "rb") as f:
            for line in f:
                loads(line)
                n += 1
    return n


def ours(gen: Path, actor: Path) -> int:
    from rl_msprobe.dumps.correlate import correlate

    return len(correlate(gen, actor).pairs)


def best_of(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat))


_PEAK = """
import sys, tracemalloc
from pathlib import Path
from rl_msprobe.dumps.correlate import correlate
import rl_msprobe.dumps.layout  # imports before tracing
tracemalloc.start()
r = correlate(Path(sys.argv[1]), Path(sys.argv[2]))
print(tracemalloc.get_traced_memory()[1], len(r.pairs), len(r.unmatched))
"""


def peak(gen: Path, actor: Path) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(gen), str(actor)], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_correlate_") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        gen, actor = generate(tmp / "full", a.lines, a.requests, dumps=True)
        print(
            f"generated {a.lines:,} dispatch lines, {a.requests:,} requests in {time.perf_counter() - t0:.1f}s"
        )
        assert ours(gen, actor) == a.requests, "every request should pair"
        t_base = best_of(lambda: baseline(gen, actor), a.repeat)
        t_ours = best_of(lambda: ours(gen, actor), a.repeat)
        print(
            f"time  json.loads only {t_base:.2f}s   correlate {t_ours:.2f}s   ratio {t_ours / t_base:.2f}x (aim <= 1.5x)"
        )

        short = generate(tmp / "short", a.lines // 10, a.requests, dumps=True)
        p_short, p_long = peak(*short), peak(gen, actor)
        print(
            f"peak  fixed {a.requests:,} requests: {a.lines // 10:,} lines {p_short[0] / 2**20:.2f} MiB, "
            f"{a.lines:,} lines {p_long[0] / 2**20:.2f} MiB   ratio {p_long[0] / p_short[0]:.2f}x (flat: ~1x)"
        )
        s2 = generate(tmp / "short_scaled", a.lines // 10, a.requests // 10, dumps=False)
        l2 = generate(tmp / "long_scaled", a.lines, a.requests, dumps=False)
        q_short, q_long = peak(*s2), peak(*l2)
        per_req = (q_long[0] - q_short[0]) / max(1, a.requests - a.requests // 10)
        print(
            f"peak  requests scaled with length ({a.requests // 10:,} -> {a.requests:,}): "
            f"{q_short[0] / 2**20:.2f} -> {q_long[0] / 2**20:.2f} MiB, ~{per_req:.0f} bytes per request "
            "(pairs/unmatched entries are the result itself)"
        )


if __name__ == "__main__":
    main()

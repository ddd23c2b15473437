"""Long lines and huge key counts: the CLI before and after the streaming readers, in one run.

Three inputs, each run through `python -m rl_msprobe` of two checkouts, in turn (before, after,
before, after, ...), each run a fresh process timed from outside (wall seconds; peak resident
memory from the kernel's accounting of that child, os.wait4), the ratio taken pair by pair:

1. `dumps correlate` on a dispatch log whose one line is a prefill step of N requests (default
   1,000,000; ~55 MB, below the 64 MiB a line may have), against a one-line training log.
2. `dumps correlate` on L one-request prefill lines (default 200,000) and the matching training
   micro-batches, each pair's two dump folders in place.
3. `dumps check` on one dump.json of K entries (default 1,000,000; ~430 MB, two tensors'
   statistics each, as msprobe writes them at statistics level).

"Before" is `git archive` of --before (default: the commit this work started from) unpacked in a
temporary folder; "after" is this checkout.

Figures (2026-12-03, 2 cores shared with other sessions' test runs; medians of 3 pairs, the
ratios taken pair by pair; before = ae66ae5). Two runs twenty minutes apart, under different loads:
  correlate, one line of 10^6 requests: before 4.6 / 4.4 s 691 MB, after 0.7 / 0.7 s 141 MB
                                        (time 6.5x / 6.3x, memory 4.9x)
  correlate, 200,000 lines, dumps:      before 47 / 31 s 332 MB, after 7.5 / 6.3 s 287 MB
                                        (time 5.6x / 5.1x, memory 1.2x: the result's 200,000 pairs)
  check, dump.json of 10^6 entries:     before 14 / 28 s 2,442 MB, after 0.9 / 1.1 s 27 MB
                                        (time 16.7x / 25.4x, memory 89x / 90x)
The values are decoded by msgspec a batch of text at a time (requests into validated structs,
dump entries only checked as JSON), json reading what msgspec refuses. What is left of the
second input's time is its 800,000 lstat calls (two per dump folder: is it, or its folder, a
link) and the Python of pairing each line; of the first, a dict entry per batched request id.
The memory is what it was before msgspec (against d11ae0d in one run: 139 -> 140 MB, 29 -> 28
MB; the 1-2 MB more in the first is msgspec itself).

Run: python benchmarks/bench_scale.py [--requests N] [--lines L] [--keys K] [--repeat R] [--before REV]
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

HERE = Path(__file__).resolve().parents[1]
BEFORE = "ae66ae5"  # main when the streaming readers were started


def one_line(root: Path, requests: int) -> list[str]:
    gen, actor = root / "gen" / "4101", root / "actor" / "5202"
    gen.mkdir(parents=True)
    actor.mkdir(parents=True)
    with open(gen / "dispatch_log.jsonl", "w") as f:
        f.write('{"source": "dispatch", "timestamp": 1.7e9, "pid": 4101, "rank": 0, "step": 0, ')
        f.write('"phase": "prefill", "total_num_scheduled_tokens": 0, "requests": [')
        f.write(
            ", ".join(f'{{"request_id": "{i:07x}", "type": "new", "tokens": 96}}' for i in range(requests))
        )
        f.write("]}\n")
    (actor / "update_actor_log.jsonl").write_text(
        json.dumps({"pid": 5202, "rank": 0, "step": 0, "request_ids": [f"{1:07x}"]}) + "\n"
    )
    return ["dumps", "correlate", str(root / "gen"), str(root / "actor")]


def many_lines(root: Path, lines: int) -> list[str]:
    gen, actor = root / "gen" / "4101", root / "actor" / "5202"
    gen.mkdir(parents=True)
    actor.mkdir(parents=True)
    with open(gen / "dispatch_log.jsonl", "w") as f:
        for i in range(lines):
            request = {"request_id": f"{i:032x}-0000beef", "type": "new", "tokens": 96}
            f.write(
                json.dumps(
                    {
                        "pid": 4101,
                        "rank": 0,
                        "step": i,
                        "tp_size": 1,
                        "phase": "prefill",
                        "requests": [request],
                    }
                )
                + "\n"
            )
    with open(actor / "update_actor_log.jsonl", "w") as f:
        for i in range(lines):
            f.write(json.dumps({"pid": 5202, "rank": 0, "step": i, "request_ids": [f"{i:032x}"]}) + "\n")
    for side in (gen, actor):  # each pair's two dumps, as a consistency run leaves them
        for i in range(lines):
            folder = side / f"step{i}" / "rank0"
            folder.mkdir(parents=True)
            (folder / "dump.json").write_text("{}")
    return ["dumps", "correlate", str(root / "gen"), str(root / "actor")]


def many_keys(root: Path, keys: int) -> list[str]:
    folder = root / "step0" / "rank0"
    folder.mkdir(parents=True)
    tensor = {"type": "torch.Tensor", "dtype": "torch.bfloat16", "shape": [4, 64], "Max": 1.5, "Min": -1.25}
    tensor.update({"Mean": 0.01, "Norm": 12.5, "requires_grad": False, "data_name": "-1"})
    with open(folder / "dump.json", "w") as f:
        f.write('{\n "task": "statistics",\n "level": "L1",\n "framework": "pytorch",\n "data": {\n')
        for i in range(keys):
            entry = {"input_args": [{**tensor, "Max": 1.5 + i}], "input_kwargs": {}, "output": [tensor]}
            f.write(f'  "Functional.linear.{i}.forward": {json.dumps(entry)}{"," if i < keys - 1 else ""}\n')
        f.write(" }\n}\n")
    return ["dumps", "check", str(root), "--mode", "inference"]


EXPECTED = {"one-line": 1, "lines": 0, "keys": 0}  # no pair / every line pairs / complete


def imported(checkout: Path) -> Path:
    """Where `python -m rl_msprobe` run as `run` runs it imports rl_msprobe from."""
    code = "import rl_msprobe; print(rl_msprobe.__file__)"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=checkout, capture_output=True, text=True)
    return Path(out.stdout.strip()).resolve().parents[1]


def run(checkout: Path, args: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak resident bytes, exit code) of one fresh `python -m rl_msprobe ARGS`."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    proc = subprocess.Popen(  # cwd: `-m` puts it first on sys.path, before PYTHONPATH
        [sys.executable, "-m", "rl_msprobe", *args],
        env=env,
        cwd=checkout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss * 1024, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--only", choices=["one-line", "lines", "keys"], action="append")
    ap.add_argument("--make", nargs=3, metavar=("CASE", "DIR", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make:
        case, folder, n = a.make
        make = {"one-line": one_line, "lines": many_lines, "keys": many_keys}[case]
        print(json.dumps(make(Path(folder), int(n))))
        return
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        root = Path(tmp)
        before = root / "before"
        before.mkdir()
        tree = subprocess.run(["git", "-C", str(HERE), "archive", a.before], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=tree.stdout, check=True)
        for checkout in (before, HERE):
            assert imported(checkout) == checkout.resolve(), f"{checkout}: imports {imported(checkout)}"
        cases = {
            "one-line": (f"correlate, one line of {a.requests:,} requests", one_line, a.requests),
            "lines": (f"correlate, {a.lines:,} lines", many_lines, a.lines),
            "keys": (f"check, dump.json of {a.keys:,} entries", many_keys, a.keys),
        }
        for key, (label, _, n) in cases.items():
            if a.only and key not in a.only:
                continue
            # made by a child: a parent grown by the input would count in each run's peak (fork)
            make_it = [sys.executable, __file__, "--make", key, str(root / key), str(n)]
            args = json.loads(subprocess.run(make_it, check=True, capture_output=True, text=True).stdout)
            old, new = [], []
            for _ in range(a.repeat):
                old.append(run(before, args))
                new.append(run(HERE, args))
            codes = {r[2] for r in old + new}
            assert codes == {EXPECTED[key]}, f"{label}: exit codes {old} {new}, not {EXPECTED[key]}"
            med = statistics.median
            t_ratio = med(o[0] / n_[0] for o, n_ in zip(old, new))
            m_ratio = med(o[1] / n_[1] for o, n_ in zip(old, new))
            print(
                f"{label}: before {med(o[0] for o in old):.1f} s {med(o[1] for o in old) / 1e6:,.0f} MB, "
                f"after {med(n_[0] for n_ in new):.1f} s {med(n_[1] for n_ in new) / 1e6:,.0f} MB "
                f"(time {t_ratio:.1f}x, memory {m_ratio:.1f}x better)",
                flush=True,
            )


if __name__ == "__main__":
    main()

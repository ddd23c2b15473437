"""Issue 45's hostile inputs, before and after: each case of tests/support/hostile.py built afresh and
run by each CHECKOUT's code in a process of its own; its exit code, the line a user reads first, the
wall time and the peak resident memory (GNU time's %M: /usr/bin/time and prlimit are needed).

    python benchmarks/bench_hostile_inputs.py --checkout /work/main --checkout . [--case NAME ...]

Each run is killed at --limit-s (default 30 s: a reader that blocks on a FIFO shows as `killed`, its
memory `?`) and its address space capped at 4 GiB (an unbounded reader of /dev/zero then ends in MemoryError instead
of taking the shared machine's memory). Prints a markdown table; the target is <= 10 s and <= 1 GiB
for every case on the branch.

Measured 2026-12-07 on the shared 2-core machine: see the issue-45 part B report (the table is
printed, not kept here).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import hostile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", type=Path, required=True)
    parser.add_argument("--case", action="append", default=[], help="only these cases (default: all)")
    parser.add_argument("--limit-s", type=float, default=30.0)
    args = parser.parse_args()
    cases = [c for c in hostile.CASES if not args.case or c.name in args.case]
    print("| case | input | checkout | exit | first line | s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        for checkout in args.checkout:
            with tempfile.TemporaryDirectory(prefix=f"hostile-{case.name}-") as tmp:
                folder = Path(tmp)
                run = hostile.measure(case.build(folder), checkout.resolve(), limit_s=args.limit_s)
                if (folder / "d").is_dir():  # the nested case: Python's rmtree recurses
                    import subprocess

                    subprocess.run(["rm", "-rf", str(folder / "d")], check=True)
            line = (
                hostile.first_line(run.out, run.err)
                if run.code is not None
                else f"killed at {args.limit_s:.0f} s"
            )
            line = line.replace("|", "\\|").replace(tmp, "TMP")
            shown = line if len(line) <= 160 else line[:157] + "..."
            code = "killed" if run.code is None else str(run.code)
            peak = f"{run.peak_rss / (1 << 20):.0f}" if run.peak_rss >= 0 else "?"
            print(
                f"| {case.name} | {case.what} | {checkout} | {code} | {shown} | {run.seconds:.1f} | {peak} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Cost of the training side's per-token records on the actor's log-prob forward (issue 44 item 2).

The REAL verl 0.9.1 FSDP engine (`FSDPEngineWithLMHead.forward_backward_batch`, forward-only, the
packed use_remove_padding layout), patched by `rl-msprobe patch apply verl-engine`, over a random
fp32 transformers Qwen2, FSDP2 on a one-rank gloo CPU group (tests/support/verl_records_scenario.py,
in the job venv). One batch of 6 requests (2 micro-batches of 3), the same process, modes in turn
each round after a warm-up round: not recorded (RL_MSPROBE_RECORD_DIR unset), every request
recorded, one request of the 6 recorded (RL_MSPROBE_RECORD_IDS). Ratios are medians of each
round's recorded / unrecorded time (paired, so the machine's load changes cancel within a round).

The stats are computed where the tensors live (a few reductions per module input / output on the
selected rows, one host copy per forward); on CPU the reductions compete with the forward's own
matmuls, on an accelerator they are small kernels beside large ones.

Measured 2026-12-07 20:13 UTC on the shared 2-core machine (load average 9-12, other sessions'
tests running; torch 2.13 CPU, OMP_NUM_THREADS=1, verl 0.9.1), the defaults (hidden 512, 4 layers,
vocab 8192, 1408 tokens in 2 micro-batches), 21 rounds:
  not recorded 0.901 s; every request recorded 1.056 s, 1.13x median [0.76-1.78];
  one request of 6 recorded 0.964 s, 1.05x median [0.69-1.68];
  ~1.8 MB of records per batch with every request recorded (108 tensors x 1408 tokens x 12 B).
The same at --scale 16 (704 tokens), 9 rounds: 1.05x (every request), 0.98x (one of 6). The spread
is the machine's load (one round of an earlier run, load 18, went 0.24x-6.4x); the medians are the
figure. No accelerator was lent to this task: the device-side figure is still to be measured.

Again 2026-12-07 21:15 UTC (load average 1.8), 7 rounds, after the recorder's cost work (a
contiguous selection is a view, Max / Min / norm without a float32 copy on an accelerator, one
host copy per forward): not recorded 0.518 s; every request 0.559 s, 1.07x median [1.04-1.12];
one of 6 1.03x [0.96-1.09]. The recorder before that work (`--recorder`, integ's), 21:03 (load
3.6): 1.11x [1.09-1.20] every request, 1.02x one of 6: on CPU and float32 the difference is
within the noise (the packed rows were one range and the copies small beside the matmuls).
2026-12-08 01:09 UTC (load 1.2), the per-tensor path trimmed (bench_rollout_records.py): every request
0.558 s, 1.06x median [1.03-1.09]; one of 6 1.03x [0.99-1.07].

Run: python benchmarks/bench_train_records.py [--repeat 5] [--hidden 512] [--layers 4] [--vocab 8192] [--scale 32]
[--recorder FILE: the tree's rl_msprobe_records.py replaced by FILE, e.g. an older one]
(needs the job venv: python -m tests.support.job_venv build)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCENARIO = ROOT / "tests" / "support" / "verl_records_scenario.py"


def run(python: Path, tree: Path, work: Path, bench: dict) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DUMP_", "RL_MSPROBE_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(PYTHONPATH=str(tree), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    spec = {"workdir": str(work), "bench": bench}
    proc = subprocess.run(
        [str(python), str(SCENARIO), json.dumps(spec)], capture_output=True, text=True, env=env, cwd=work
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    if proc.returncode or not lines:
        sys.exit(f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT:") :])
    if result["error"]:
        sys.exit(result["error"]["traceback"])
    return result["bench"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--scale", type=int, default=32, help="prompt / response lengths x this (3..6 x scale)"
    )
    parser.add_argument("--recorder", type=Path, help="replace the tree's rl_msprobe_records.py with this")
    args = parser.parse_args()

    from tests.support import verl_venv
    from tests.support.trees import patched_release

    python = verl_venv.VENV.python_of(verl_venv.VENV.venv_dir())
    if not python.exists():
        sys.exit(f"no job venv at {python}: build it with `python -m tests.support.job_venv build`")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        tree = patched_release("verl", "0.9.1", base / "verl", ["verl-engine"])
        if args.recorder:  # e.g. an older recorder, for a before / after figure
            shutil.copyfile(args.recorder, tree / "verl/utils/rl_msprobe_records.py")
        (base / "work").mkdir()
        bench = {
            "repeat": args.repeat,
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": args.vocab,
            "scale": args.scale,
        }
        out = run(python, tree, base / "work", bench)
        records = sorted((base / "work" / "bench-records").rglob("rec*.f32"))
        size = sum(p.stat().st_size + p.with_suffix(".json").stat().st_size for p in records)
    seconds = out["seconds"]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"batch {out['tokens']} tokens in 2 micro-batches"
    )
    print(f"not recorded: {statistics.median(seconds['off']):.3f} s median ({args.repeat} rounds)")
    for mode, what in (("all", "every request"), ("one", "one request of 6")):
        ratios = [on / off for on, off in zip(seconds[mode], seconds["off"])]
        print(
            f"{what} recorded: {statistics.median(seconds[mode]):.3f} s, "
            f"{statistics.median(ratios):.2f}x median [{min(ratios):.2f}-{max(ratios):.2f}]"
        )
    print(f"records written: {len(records)} forwards, {size} bytes")


if __name__ == "__main__":
    main()

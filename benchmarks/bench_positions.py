"""Whole-response compare of one request on the stand-in (issue 32): dump sizes, compare time, and the
size estimate `position_size.estimate` gives for the same model, side by side.

Runs tests/dumps/position_standin.py (tiny Qwen2, hidden 128, 2 layers, prompt 8, response 6):
the rollout with every step in tensor mode, the rollout's decode steps in statistics mode, and the
training forward over prompt + response in tensor mode; then `positions.compare_request` (prefill
tensor + decode statistics, and all tensor), timed. The estimate is computed for every module the
stand-in dumps at L0, so that its per-file and per-leaf constants are checked against msprobe.

Measured 2026-12-03 on the shared 2-core machine (msprobe 26.2.0, torch 2.13 CPU):
  compare_request 0.12 s (prefill tensor + decode statistics), 0.10 s (all tensor)
  decode steps, statistics: 143 848 B measured, 110 400 B estimated
  decode steps, tensor:   9 996 728 B measured, 9 676 845 B estimated
  prefill, tensor:        2 300 742 B measured, 2 193 445 B estimated
  training forward:       2 633 340 B measured, 2 414 653 B estimated
  tensor files per training forward: 111 measured, 69 estimated (transformers passes rotary cos/sin
  and masks as keyword tensors, which the module table does not count)
  Qwen2.5-7B, prompt 256, response 1024, bf16, default modules: 34 GiB estimated

Run: python benchmarks/bench_positions.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_msprobe.dumps import position_size, positions  # noqa: E402

STANDIN = ROOT / "tests/dumps/position_standin.py"
TINY = position_size.ModelShape(
    hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512
)
ALL = tuple(TINY.modules())


def size(root: Path) -> tuple[int, int]:
    files = [
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in (".json", ".pt") and "msprobe_config" not in p.name
    ]
    keep = [p for p in files if p.name not in ("stack.json", "construct.json")]
    return sum(p.stat().st_size for p in keep), sum(1 for p in keep if p.suffix == ".pt")


def steps(root: Path) -> list[Path]:
    return [next(s.glob("*/dump.json")) for s in sorted(root.glob("step*"), key=lambda p: int(p.name[4:]))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-positions-"))
    runs = {
        "rollout_tensor": (["rollout"], "tensor"),
        "rollout_decode_stats": (["rollout", "--dump", "decode"], "statistics"),
        "train": (["train"], "tensor"),
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, str(STANDIN), args[0], str(base / k), *args[1:]],
            env={**os.environ, "STANDIN_TASK": task},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for k, (args, task) in runs.items()
    }
    for k, p in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"{k} failed")
    tensor_steps = steps(base / "rollout_tensor")
    prefill = positions.read_forward(tensor_steps[0])
    stats = [positions.read_forward(s) for s in steps(base / "rollout_decode_stats")]
    tensor_decodes = [positions.read_forward(s) for s in tensor_steps[1:]]
    train = positions.read_forward(steps(base / "train")[0])
    for label, decodes in (("prefill tensor + decode statistics", stats), ("all tensor", tensor_decodes)):
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = positions.compare_request(prefill, decodes, train)
            times.append(time.perf_counter() - t0)
        print(f"compare ({label}): {statistics.median(times):.2f} s median of {a.repeat}; {r.status}")
    prefill_bytes = sum(
        p.stat().st_size
        for p in tensor_steps[0].parent.rglob("*")
        if p.suffix in (".pt", ".json") and p.name not in ("stack.json", "construct.json")
    )
    measured = {k: size(base / k) for k in runs}
    decode_tensor = measured["rollout_tensor"][0] - prefill_bytes
    for task in ("statistics", "tensor"):
        e = position_size.estimate(TINY, 8, 6, modules=ALL, dtype_bytes=4, decode_task=task, head=True)
        got_decode = measured["rollout_decode_stats"][0] if task == "statistics" else decode_tensor
        print(f"decode steps in {task}: measured {got_decode} B, estimated {e.rollout_decode} B")
    e = position_size.estimate(TINY, 8, 6, modules=ALL, dtype_bytes=4, head=True)
    print(f"prefill (tensor): measured {prefill_bytes} B, estimated {e.rollout_prefill} B")
    print(f"training forward (tensor): measured {measured['train'][0]} B, estimated {e.train} B")
    print(f"tensor files: measured {measured['train'][1]} per training forward, estimated {e.files // 2}")
    big = position_size.estimate(position_size.QWEN2_5_7B, 256, 1024)
    print(f"Qwen2.5-7B, prompt 256, response 1024, bf16, default modules: {big.describe()}")
    print(f"(dumps in {base})")


if __name__ == "__main__":
    main()

"""Cost of triage's distribution per position (issue 46) on the training engine's log-prob forward.

The REAL verl 0.9.1 FSDP engine (`FSDPEngineWithLMHead.forward_backward_batch`, forward-only, the
packed use_remove_padding layout, calculate_entropy=True as verl's old-log-prob call sets it),
patched by `rl-msprobe patch apply verl-triage`, over a random fp32 transformers Qwen2, FSDP2 on a
one-rank gloo CPU group (tests/support/verl_topk_scenario.py, in the job venv). The same batch, the
same process, in turn each round after a warm-up round: RL_MSPROBE_TRIAGE_TOPK unset (verl's own
work: logits, log-softmax of the sampled token, entropy) and set (plus, at the response rows only,
logsumexp, entropy, the rollout's k ids' log-probs and the engine's own top k). Ratios: medians of
each round's on / off time.

Measured 2026-12-07 on the shared 2-core machine (torch 2.13 CPU, OMP_NUM_THREADS=1, verl 0.9.1),
the defaults (hidden 512, 4 layers, vocab 32768, k 20, 1408 tokens, 672 response positions):
  23:44 UTC, load average 12.8, 7 rounds: 3.821 s without, 4.183 s with, 1.058x median
  [0.926-1.224] (the logsumexp from verl's float32 log-probs: one copy of the response rows, one
  top-k, one gather). The first version (its own logsumexp and a softmax entropy over the
  response rows) measured 1.117x (23:40, load 10) and 1.136x (23:41, load 8): a log-prob-shaped
  pass over [rows, vocab] costs ~5% here. That remains the path when verl's log-probs are not
  float32 (bf16 under CPU autocast, as in the live job): between the two figures.
No accelerator was used; there the top-k and gather are two kernels beside the lm_head matmul.

Run: python benchmarks/bench_triage_topk.py [--repeat 5] [--k 20] [--hidden 512] [--layers 4]
[--vocab 32768] [--scale 32]   (needs the job venv: python -m tests.support.job_venv build)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCENARIO = ROOT / "tests" / "support" / "verl_topk_scenario.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument(
        "--scale", type=int, default=32, help="prompt / response lengths x this (3..6 x scale)"
    )
    args = parser.parse_args()

    from tests.support import verl_venv
    from tests.support.trees import patched_release

    python = verl_venv.VENV.python_of(verl_venv.VENV.venv_dir())
    if not python.exists():
        sys.exit(f"no job venv at {python}: build it with `python -m tests.support.job_venv build`")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        tree = patched_release("verl", "0.9.1", base / "verl", ["verl-triage"])
        (base / "work").mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RL_MSPROBE_") and k != "PYTHONPATH"}
        env.update(PYTHONPATH=str(tree), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
        spec = {"workdir": str(base / "work"), **vars(args)}
        proc = subprocess.run(
            [str(python), str(SCENARIO), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            cwd=base / "work",
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    if proc.returncode or not lines:
        sys.exit(f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(lines[-1][len("RESULT:") :])
    if not out["rows"]:
        sys.exit("the patched engine returned no top-k rows: the measurement would be of nothing")
    off, on = out["seconds"]["off"], out["seconds"]["on"]
    ratios = [a / b for a, b in zip(on, off)]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; k {args.k}; "
        f"{out['tokens']} tokens ({out['responses']} response positions) in 2 micro-batches"
    )
    print(f"log-prob forward without top-k: {statistics.median(off):.3f} s median ({args.repeat} rounds)")
    print(
        f"with top-k: {statistics.median(on):.3f} s, {statistics.median(ratios):.3f}x median "
        f"[{min(ratios):.3f}-{max(ratios):.3f}]; rows per sequence {out['rows']}"
    )


if __name__ == "__main__":
    main()

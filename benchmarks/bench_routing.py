"""Cost of the MoE routing records (the verl-routing helper, rl_msprobe_routing.py) on both sides.

Trainer: a random fp32 Transformers Qwen3-MoE (defaults: hidden 512, 4 layers, 16 experts top-4,
vocab 8192) runs the log-prob forward of a packed batch (verl's remove-padding layout: one row,
position_ids restarting per sequence) without grad. Each round times the same forward twice, in
turn: on a copy of the model that never had hooks, and on the model whose gates the helper hooked,
armed as verl's compute_log_prob arms it (`begin` / `end`): top-k + margin per gate, one host copy
per forward, one JSON line per sequence written to a temporary folder. The ratio is the median of
the rounds' recorded / plain times (paired: the machine's load cancels within a round).

Rollout: vLLM CPU (offline `LLM`, V1 runner, enforce_eager) serving the same model saved to disk,
generating N requests x T tokens; each round runs the same generate with the folder unset (hooks
installed, each returning at once) and set (every forward recorded). Ratio: median of the rounds.

Measured 2026-12-07 23:48 UTC on the shared 2-core machine (load average 8-12: other sessions'
jobs), torch 2.13 CPU, OMP_NUM_THREADS=1, the defaults, 7 rounds:
  trainer: plain 2.023 s, recorded 2.029 s (medians); ratio 1.07x median [0.72-1.82] (the spread is
  the load); 166 KB of JSON per forward of 1408 tokens (4 layers x top-4 + margins);
  rollout (8 requests x 32 new tokens, 64-token prompts): plain 0.346 s, recorded 0.377 s; 1.14x
  median [1.05-1.87]. The rollout's model is tiny beside its per-forward Python work (one JSON
  line per request and forward): a real model's forward makes the share smaller. No accelerator
  figure yet.

Run: python benchmarks/bench_routing.py [--rounds 7] [--hidden 512] [--layers 4] [--experts 16]
[--top-k 4] [--tokens 1408] [--requests 8] [--new-tokens 32] [--no-rollout]
(needs the job venv: python -m tests.support.job_venv build)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKER = r"""
import copy, json, os, statistics, sys, tempfile, time, types
import torch
args = json.loads(os.environ["BENCH_ROUTING_ARGS"])
sys.path.insert(0, args["helper"])
import rl_msprobe_routing as routing
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=2 * args["hidden"],
    moe_intermediate_size=args["hidden"] // 2, num_hidden_layers=args["layers"], num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, num_experts=args["experts"], num_experts_per_tok=args["top_k"],
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, torch_dtype="float32")
plain = Qwen3MoeForCausalLM(config).eval()
hooked = copy.deepcopy(plain)
out = {}
folder = tempfile.mkdtemp()
os.environ["RL_MSPROBE_TRIAGE"] = folder
worker = types.SimpleNamespace(actor=types.SimpleNamespace(engine=types.SimpleNamespace(module=hooked)),
    enable_routing_replay=False, config=None)
n_seq = 8
length = args["tokens"] // n_seq
ids = torch.randint(0, args["vocab"], (1, n_seq * length))
pos = torch.arange(length).repeat(n_seq).unsqueeze(0)

def timed(model, armed):
    token = routing.begin(worker, None) if armed else None
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    t = time.perf_counter() - t
    routing.end(token)
    return t

timed(plain, False); timed(hooked, True)  # warm-up (and the hooks installed)
ratios, a, b = [], [], []
for _ in range(args["rounds"]):
    x, y = timed(plain, False), timed(hooked, True)
    a.append(x); b.append(y); ratios.append(y / x)
size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(folder) for f in fs)
out["train"] = {"plain_s": statistics.median(a), "recorded_s": statistics.median(b),
    "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
    "tokens": int(ids.shape[1]), "bytes_per_forward": size // (args["rounds"] + 1)}
if args["rollout"]:
    model_dir = tempfile.mkdtemp()
    plain.save_pretrained(model_dir)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(args["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")); tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t2").save_pretrained(model_dir)
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=512, max_num_seqs=args["requests"], seed=0,
              dtype="float32", enable_prefix_caching=False)
    w = llm.llm_engine.model_executor.driver_worker.worker
    routing.rollout(w)
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(3, args["vocab"], (64,))]} for _ in range(args["requests"])]
    params = SamplingParams(max_tokens=args["new_tokens"], min_tokens=args["new_tokens"], temperature=1.0, seed=0)
    def gen(on):
        if on: os.environ["RL_MSPROBE_TRIAGE"] = folder
        else: os.environ.pop("RL_MSPROBE_TRIAGE", None)
        t = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); return time.perf_counter() - t
    gen(False); gen(True)
    ratios, a, b = [], [], []
    for _ in range(args["rounds"]):
        x, y = gen(False), gen(True)
        a.append(x); b.append(y); ratios.append(y / x)
    out["rollout"] = {"plain_s": statistics.median(a), "recorded_s": statistics.median(b),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "requests": args["requests"], "new_tokens": args["new_tokens"]}
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=1408)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-rollout", action="store_true")
    opts = parser.parse_args()
    from tests.support import vllm_cpu
    from tests.support.job_venv import VENV

    python = VENV.build()
    args = {
        "helper": str(ROOT / "rl_msprobe/patches/files/verl/verl/utils"),
        "rounds": opts.rounds,
        "hidden": opts.hidden,
        "layers": opts.layers,
        "experts": opts.experts,
        "top_k": opts.top_k,
        "vocab": opts.vocab,
        "tokens": opts.tokens,
        "requests": opts.requests,
        "new_tokens": opts.new_tokens,
        "rollout": not opts.no_rollout,
    }
    env = vllm_cpu.engine_env(
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), BENCH_ROUTING_ARGS=json.dumps(args)
    )
    with tempfile.TemporaryDirectory() as cwd:
        proc = vllm_cpu.run_in_venv(python, WORKER, env, Path(cwd), timeout=3000)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

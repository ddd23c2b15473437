"""The verl-routing helper's trainer side on a real Transformers Qwen3-MoE (tiny, random, made from
a config in the job venv: torch + transformers 5, tests/support/job_venv.py), as verl's actor calls
it: `begin(worker, data)` / forward(s) without grad / `end`. What it records per sequence must be
the model's own router decisions: the top-k of the router logits Transformers returns
(`output_router_logits=True`) for the same rows, and the margin between the k-th and (k+1)-th
logit — for verl's remove-padding input (one packed row, position_ids restarting at 0) and for a
padded batch (attention_mask); nothing from a forward with grad (the update) or after `end`. A
rollout model that is not eager gets no hook and one error line.
The rollout side runs on the live job (tests/live/test_live_routing.py, full tier).
~10 s (torch and transformers import)."""

from __future__ import annotations

import json
import os

from tests.support import vllm_cpu
from tests.support.job_venv import VENV

HELPER = "rl_msprobe/patches/files/verl/verl/utils"

SCRIPT = r"""
import json, os, sys, types
import torch
sys.path.insert(0, os.environ["HELPER_DIR"])
import rl_msprobe_routing as routing
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=6,
    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
model = Qwen3MoeForCausalLM(config).eval()
worker = types.SimpleNamespace(actor=types.SimpleNamespace(engine=types.SimpleNamespace(module=model)),
    enable_routing_replay=False, config=None)
seqs = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 10]]

def expected(ids, **kw):
    out = model(input_ids=ids, output_router_logits=True, **kw)
    rows = []
    for layer_logits in out.router_logits:
        values, top = torch.topk(layer_logits.float(), 3, dim=-1)
        rows.append((top[:, :2].tolist(), (values[:, 1] - values[:, 2]).tolist()))
    return rows

token = routing.begin(worker, {"input_ids": None})
with torch.no_grad():
    packed = torch.tensor([sum(seqs, [])])
    positions = torch.tensor([[p for s in seqs for p in range(len(s))]])
    want_packed = expected(packed, position_ids=positions)
    width = max(map(len, seqs))
    padded = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    want_padded = expected(padded, attention_mask=mask)
routing.end(token)
with torch.no_grad():
    model(input_ids=packed, position_ids=positions)  # after end: not recorded
token = routing.begin(worker, None)
model(input_ids=packed, position_ids=positions)  # with grad (an update): not recorded
routing.end(token)
# a vLLM worker whose model is not eager (CUDA graphs replay without hooks): one error line, no hook
runner = types.SimpleNamespace(model=Qwen3MoeForCausalLM(config), model_config=types.SimpleNamespace(
    enforce_eager=False, hf_config=config))
routing.rollout(types.SimpleNamespace(model_runner=runner))
assert not runner.model.model.layers[0].mlp.gate._forward_hooks
print(json.dumps({"packed": want_packed, "padded": want_padded, "mask": mask.tolist()}))
"""


def test_trainer_records_are_the_models_own_router_decisions(tmp_path) -> None:
    python = VENV.python_or_skip()
    env = {**vllm_cpu.engine_env(), "RL_MSPROBE_TRIAGE": str(tmp_path), "HELPER_DIR": os.path.abspath(HELPER)}
    proc = vllm_cpu.run_in_venv(python, SCRIPT, env, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads(proc.stdout.strip().splitlines()[-1])
    (log,) = tmp_path.glob("*/routing.jsonl")
    docs = [json.loads(line) for line in log.read_text().splitlines()]
    *docs, error = docs
    assert error["side"] == "rollout" and "enforce_eager=True" in error["error"], error
    head, lines = docs[0], docs[1:]
    assert head["kind"] == "header" and head["side"] == "train" and head["top_k"] == 2, head
    assert head["layers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"], head
    assert head["replay"] == {"mode": "none", "enabled": False, "rollout_experts_in_batch": False}
    seqs = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 10]]
    # two forwards recorded (packed, padded), three sequences each; nothing after end or with grad
    assert [d["tokens"] for d in lines] == seqs + seqs, [d["tokens"] for d in lines]
    assert all(d["call"] == 1 for d in lines)
    width = max(map(len, seqs))
    starts = [0, 6, 9]
    for i, doc in enumerate(lines):
        packed = i < 3
        rows = (
            [starts[i] + j for j in range(len(seqs[i]))]
            if packed
            else [(i - 3) * width + width - len(seqs[i - 3]) + j for j in range(len(seqs[i - 3]))]
        )
        source = want["packed" if packed else "padded"]
        for j, row in enumerate(rows):
            for layer, (top, margins) in enumerate(source):
                assert doc["experts"][j][layer] == top[row], (i, j, layer)
                assert abs(doc["margins"][j][layer] - margins[row]) <= 1e-5 * max(1.0, abs(margins[row]))

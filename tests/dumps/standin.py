"""Stand-in rollout and training processes for the dumps end-to-end test.

Until the vLLM CPU venv (patched with `vllm-dump`) and the verl training helper can be run
here, this script plays both sides with a tiny Qwen2 (vocab 512, hidden 128, intermediate 256,
2 layers, 4 heads, 2 kv heads, random weights, no hub):

- ``rollout``: a module tree named like vLLM's Qwen2 (fused ``qkv_proj`` / ``gate_up_proj``,
  ``QKVParallelLinear``, ``RowParallelLinear``, ``SiluAndMul``, ``logits_processor``; tokens
  flattened to ``[T, H]``) fed with the same weights; one msprobe step per model step,
  ``{out}/{pid}/dispatch_log.jsonl`` in the DOMAIN §6 format, vLLM ≥ 0.14 id suffixes.
- ``train``: transformers' own ``Qwen2ForCausalLM`` wrapped the way FSDP1 names modules
  (``_fsdp_wrapped_module``) or, with ``--fsdp2``, by the real FSDP2 ``fully_shard``, run one request per micro-batch (prompt only) through
  rl-msprobe's real training helper (``verl/utils/rl_msprobe_hooks.py``, the calls the patched
  FSDPEngine makes): one msprobe step per micro-batch in ``{out}/step{N}/...`` and
  ``{out}/{pid}/update_actor_log.jsonl``.

Each side is its own process because msprobe's PrecisionDebugger is a per-process singleton.
Usage: python standin.py rollout|train OUT [--perturb LAYER] [--no-pid-level] [--model DIR --prompts JSON]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

PROMPTS = {  # request id (as verl sends it) -> prompt token ids
    "3f2a9c1e7b6d4e5fa0b1c2d3e4f50617": [1, 17, 42, 99, 5, 311, 27, 64],
    "9a8b7c6d5e4f40312a1b2c3d4e5f6071": [1, 250, 3, 77, 401, 12],
    "0c1d2e3f4a5b46c7d8e9f0a1b2c3d4e5": [1, 8, 88, 188, 288],
}
VLLM_SUFFIX = {rid: f"{i:02d}c0ffee"[-8:] for i, rid in enumerate(PROMPTS)}


def hf_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).eval()


# ---------------------------------------------------------------- vLLM-named rollout tree
class VocabParallelEmbedding(nn.Embedding):
    pass


class ParallelLMHead(nn.Linear):
    pass


class QKVParallelLinear(nn.Linear):
    pass


class MergedColumnParallelLinear(nn.Linear):
    pass


class RowParallelLinear(nn.Linear):
    pass


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def forward(self, positions, q, k):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

        def rot(x):
            x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
            return torch.cat((-x2, x1), dim=-1)

        t = q.shape[0]
        q = q.view(t, -1, self.head_dim)
        k = k.view(t, -1, self.head_dim)
        return (q * cos + rot(q) * sin).reshape(t, -1), (k * cos + rot(k) * sin).reshape(t, -1)


class Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(t, -1)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.q_size, self.kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(hd, cfg.rope_parameters["rope_theta"])
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, hd)

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden_states):
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden_states):
        return lm_head(hidden_states)


class VllmQwen2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids, positions):
        return self.logits_processor(self.lm_head, self.model(input_ids, positions))


@torch.no_grad()
def vllm_model_from(hf) -> VllmQwen2ForCausalLM:
    cfg = hf.config
    m = VllmQwen2ForCausalLM(cfg).eval()
    m.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    m.model.norm.weight.copy_(hf.model.norm.weight)
    m.lm_head.weight.copy_(hf.lm_head.weight)
    for ours, theirs in zip(m.model.layers, hf.model.layers):
        a, b = ours.self_attn, theirs.self_attn
        a.qkv_proj.weight.copy_(torch.cat([b.q_proj.weight, b.k_proj.weight, b.v_proj.weight]))
        a.qkv_proj.bias.copy_(torch.cat([b.q_proj.bias, b.k_proj.bias, b.v_proj.bias]))
        a.o_proj.weight.copy_(b.o_proj.weight)
        ours.mlp.gate_up_proj.weight.copy_(
            torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
        )
        ours.mlp.down_proj.weight.copy_(theirs.mlp.down_proj.weight)
        ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
        ours.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
    return m


# ---------------------------------------------------------------- FSDP1-named training tree
class FullyShardedDataParallel(nn.Module):
    """Names modules the way FSDP1 does (`_fsdp_wrapped_module`); shards nothing."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._fsdp_wrapped_module = module

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


def fsdp2(hf) -> nn.Module:
    """The real FSDP2: `fully_shard` on each decoder layer, then the root, on a single-process
    gloo group over a CPU mesh (as verl's FSDP2 actor wraps it; module names stay as they are)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(hf, mesh=mesh)


def fsdp_like(hf) -> nn.Module:
    for i, layer in enumerate(hf.model.layers):
        hf.model.layers[i] = FullyShardedDataParallel(layer)
    return FullyShardedDataParallel(hf)


# ---------------------------------------------------------------- the two processes
def msprobe_config(dump_path: str) -> dict:
    """Forward dumps; task from $STANDIN_TASK (tensor: cosine; statistics: msprobe's default),
    level from $STANDIN_LEVEL (L0 default; `mix` is what `prepare` writes)."""
    task = os.environ.get("STANDIN_TASK", "tensor")
    section = {"scope": [], "list": [], "data_mode": ["forward"]}
    if task == "statistics":
        section["summary_mode"] = "statistics"
    level = os.environ.get("STANDIN_LEVEL", "L0")
    return {"task": task, "dump_path": dump_path, "rank": [], "step": [], "level": level, task: section}


def debugger(out: str, dump_path: str):
    from msprobe.pytorch import PrecisionDebugger

    cfg = msprobe_config(dump_path)
    os.makedirs(dump_path, exist_ok=True)
    path = os.path.join(out, f"msprobe_config_{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return PrecisionDebugger(config_path=path)


def perturb(hf, layer: int) -> None:
    if layer >= 0:
        with torch.no_grad():
            w = hf.model.layers[layer].mlp.down_proj.weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std())


def log_line(f, **fields) -> None:
    f.write(json.dumps(fields) + "\n")
    f.flush()


def run_rollout(out: str, layer: int, pid_level: bool) -> None:
    hf = hf_model()
    perturb(hf, layer)
    model = vllm_model_from(hf)
    pid = os.getpid()
    base = os.path.join(out, str(pid)) if pid_level else out
    dbg = debugger(out, base)
    os.makedirs(os.path.join(out, str(pid)), exist_ok=True)
    ids = list(PROMPTS)
    # model steps as a scheduler would issue them: single prefill, decode, a batched prefill
    steps = [
        ("prefill", [(ids[0], "new", PROMPTS[ids[0]])]),
        ("decode", [(ids[0], "cached", [7])]),
        ("prefill", [(ids[1], "new", PROMPTS[ids[1]])]),
        ("prefill", [(ids[2], "new", PROMPTS[ids[2]]), (ids[0], "cached", [9])]),
    ]
    with open(os.path.join(out, str(pid), "dispatch_log.jsonl"), "w") as log:
        for n, (phase, reqs) in enumerate(steps):
            tokens = [t for _, _, toks in reqs for t in toks]
            positions = (
                torch.arange(len(tokens)) if phase == "prefill" else torch.tensor([len(PROMPTS[ids[0]])])
            )
            dbg.start(model=model)
            with torch.no_grad():
                model(torch.tensor(tokens), positions)
            dbg.stop()
            log_line(
                log,
                source="dispatch",
                timestamp=time.time(),
                pid=pid,
                rank=0,
                step=n,
                phase=phase,
                total_num_scheduled_tokens=len(tokens),
                requests=[
                    {"request_id": f"{rid}-{VLLM_SUFFIX[rid]}", "type": kind, "tokens": len(toks)}
                    for rid, kind, toks in reqs
                ],
            )
            dbg.step()


def training_helper():
    """rl-msprobe's own training-side helper (verl/utils/rl_msprobe_hooks.py as the verl-engine
    patch set adds it), loaded from this checkout: it needs neither verl nor rl-msprobe."""
    path = (
        Path(__file__).resolve().parents[2] / "rl_msprobe/patches/files/verl/verl/utils/rl_msprobe_hooks.py"
    )
    spec = importlib.util.spec_from_file_location("rl_msprobe_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_train(
    out: str, layer: int, model_dir: str | None, prompts_file: str | None, use_fsdp2: bool = False
) -> None:
    """One micro-batch per request (prompt only, as PROMPTS_ONLY leaves it) through the helper's
    micro_batch_start / micro_batch_end, the calls the patched FSDPEngine makes. With FSDP2 the
    forward runs with grad enabled, as in the actor's update (activations require grad)."""
    if model_dir:
        from transformers import Qwen2ForCausalLM

        hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        hf = hf_model()
    perturb(hf, layer)
    model = fsdp2(hf) if use_fsdp2 else fsdp_like(hf)
    if prompts_file:
        with open(prompts_file) as f:
            prompts = [(rid, ids) for rid, ids in json.load(f)]
    else:
        prompts = [(rid, PROMPTS[rid]) for rid in list(PROMPTS)[:2]]  # the batched request never pairs
    config = os.path.join(out, "msprobe_config_actor.json")
    os.makedirs(out, exist_ok=True)
    with open(config, "w") as f:
        json.dump(msprobe_config(out), f)
    os.environ.update(DUMP_ON="1", DUMP_PHASE="log_prob", MSPROBE_ACTOR_CONFIG=config)
    hooks = training_helper()
    engine = SimpleNamespace(module=model, engine_config=SimpleNamespace(forward_only=False), rank=0)
    for rid, ids in prompts:
        token = hooks.micro_batch_start(engine, {"request_id": [rid]}, True)
        with torch.set_grad_enabled(use_fsdp2):
            model(input_ids=torch.tensor([ids]))
        hooks.micro_batch_end(token)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["rollout", "train"])
    p.add_argument("out")
    p.add_argument(
        "--perturb", type=int, default=-1, help="add noise (one weight std) to this layer's mlp.down_proj"
    )
    p.add_argument(
        "--no-pid-level", action="store_true", help="rollout: dump straight into OUT (no {pid} folder)"
    )
    p.add_argument("--model", help="train: a saved Qwen2 folder instead of the random tiny one")
    p.add_argument(
        "--prompts", help="train: JSON [[request_id, [token ids]], ...] instead of the built-in prompts"
    )
    p.add_argument("--fsdp2", action="store_true", help="train: wrap with the real FSDP2 fully_shard")
    a = p.parse_args()
    if a.side == "rollout":
        run_rollout(a.out, a.perturb, not a.no_pid_level)
    else:
        run_train(a.out, a.perturb, a.model, a.prompts, a.fsdp2)


if __name__ == "__main__":
    main()

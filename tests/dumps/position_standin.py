"""Stand-in for whole-response dumps: a vLLM-named tiny Qwen2 that decodes with a KV cache, at TP=1
or as one rank of a real TP group (gloo), and the training forward over prompt + response.

- ``rollout OUT``: one msprobe step for the prompt's prefill, then one per decode step (one
  token each, at position P+k, attending over the cache), fed the fixed RESPONSE (teacher
  forcing; an engine would sample it). R response tokens make R-1 decode steps: the last
  token is never fed back. With ``WORLD_SIZE=2`` (and RANK, MASTER_ADDR/PORT) the process is
  one TP rank: column-parallel modules hold a shard of every part (q/k/v, gate/up), row-parallel
  ones a shard of their input features and all-reduce, the embedding a shard of the vocabulary.
  ``--plant MODULE --when decode|prefill [--row R] [--scale S]`` multiplies that module's output
  by 1+S in one-token forwards only (decode), or on prompt rows >= R of the prefill only.
  ``--dump prefill|decode`` dumps only those steps (msprobe's task is one per process: a
  prefill in tensor mode and decode steps in statistics mode come from two runs).
- ``train OUT [--flip POS] [--prompt-only]``: transformers' Qwen2ForCausalLM (FSDP1 names) over
  prompt + response (or the prompt alone) in one forward, one msprobe step; ``--flip`` changes
  the token at that position.
A train variant with ``per_token`` writes, instead of an msprobe step, the per-token record of
rl-msprobe's verl engine hook (``PositionRecorder``, ``DUMP_POSITIONS=1``) as
``OUT/NAME/positions/{pid}/forward{K}.json``.
``--variants JSON`` runs several of these in one process (one msprobe import), each variant's
steps moved to ``OUT/NAME/step{k}``. ``STANDIN_TASK`` picks msprobe's task (tensor by default), ``STANDIN_DTYPE=bfloat16`` the models'
dtype (float32 by default). Weights: standin.hf_model().
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = [1, 17, 42, 99, 5, 311, 27, 64]
RESPONSE = [133, 7, 250, 8, 19, 402]


def hf_model():
    return standin.hf_model().to(getattr(torch, os.environ.get("STANDIN_DTYPE", "float32")))


def tp() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    if tp()[1] > 1:
        import torch.distributed as dist

        dist.all_reduce(y)
    return y


def column(w: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """This rank's rows of a column-parallel weight (or bias) made of PARTS (dim 0)."""
    r, n = tp()
    return torch.cat([p.chunk(n, 0)[r] for p in w.split(parts, 0)])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        r, n = tp()
        self.per = weight.shape[0] // n
        self.start = r * self.per
        self.weight = nn.Parameter(weight[self.start : self.start + self.per].clone())

    def forward(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.per)
        out = F.embedding(local.clamp(0, self.per - 1), self.weight) * inside[:, None]
        return all_reduce(out)


class _ColumnParallel(nn.Module):
    """This rank's shard of every part of a fused column-parallel linear."""

    def __init__(self, w: torch.Tensor, parts: list[int], b: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(column(w, parts))
        self.bias = nn.Parameter(column(b, parts)) if b is not None else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(_ColumnParallel):
    pass


class MergedColumnParallelLinear(_ColumnParallel):
    pass


class _Sharded(nn.Module):
    """This rank's 1/n of a weight on DIM."""

    def __init__(self, w: torch.Tensor, dim: int):
        super().__init__()
        r, n = tp()
        self.weight = nn.Parameter(w.chunk(n, dim)[r].clone())


class RowParallelLinear(_Sharded):
    def __init__(self, w: torch.Tensor):
        super().__init__(w, 1)

    def forward(self, x):
        return all_reduce(F.linear(x, self.weight))


class ParallelLMHead(_Sharded):
    def __init__(self, w: torch.Tensor):
        super().__init__(w, 0)

    def forward(self, h):
        return F.linear(h, self.weight)


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, h):
        local = lm_head(h)
        if tp()[1] == 1:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(tp()[1])]
        dist.all_gather(parts, local)
        return torch.cat(parts, -1)


class Attention(nn.Module):
    """Causal attention over this rank's heads with a KV cache: a prefill (T > 1) starts it, a
    one-token decode step attends over everything cached."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        if t == 1 and self.cache is not None:
            k, v = torch.cat([self.cache[0], k], 1), torch.cat([self.cache[1], v], 1)
        self.cache = (k, v)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        return out.transpose(0, 1).reshape(t, -1)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg, hf_attn):
        super().__init__()
        n = tp()[1]
        hd = cfg.hidden_size // cfg.num_attention_heads
        heads, kv = cfg.num_attention_heads // n, cfg.num_key_value_heads // n
        self.q_size, self.kv_size = heads * hd, kv * hd
        parts = [heads * hd * n, kv * hd * n, kv * hd * n]
        w = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
        b = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
        self.qkv_proj = QKVParallelLinear(w, parts, b)
        self.o_proj = RowParallelLinear(hf_attn.o_proj.weight)
        self.rotary_emb = standin.RotaryEmbedding(hd, cfg.rope_parameters["rope_theta"])
        self.attn = Attention(heads, kv, hd)

    def forward(self, positions, h):
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.to(v.dtype), k.to(v.dtype), v))  # rotary computes in float32


class Qwen2MLP(nn.Module):
    def __init__(self, hf_mlp):
        super().__init__()
        inter = hf_mlp.gate_proj.weight.shape[0]
        w = torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight])
        self.gate_up_proj = MergedColumnParallelLinear(w, [inter, inter])
        self.down_proj = RowParallelLinear(hf_mlp.down_proj.weight)
        self.act_fn = standin.SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def _norm(hf_norm, eps: float) -> nn.Module:
    m = standin.RMSNorm(hf_norm.weight.shape[0], eps).to(hf_norm.weight.dtype)
    with torch.no_grad():
        m.weight.copy_(hf_norm.weight)
    return m


class Qwen2DecoderLayer(standin.Qwen2DecoderLayer):
    def __init__(self, cfg, hf_layer):
        nn.Module.__init__(self)
        self.self_attn = Qwen2Attention(cfg, hf_layer.self_attn)
        self.mlp = Qwen2MLP(hf_layer.mlp)
        self.input_layernorm = _norm(hf_layer.input_layernorm, cfg.rms_norm_eps)
        self.post_attention_layernorm = _norm(hf_layer.post_attention_layernorm, cfg.rms_norm_eps)


class Qwen2Model(standin.Qwen2Model):
    def __init__(self, hf):
        nn.Module.__init__(self)
        cfg = hf.config
        self.embed_tokens = VocabParallelEmbedding(hf.model.embed_tokens.weight)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, layer) for layer in hf.model.layers)
        self.norm = _norm(hf.model.norm, cfg.rms_norm_eps)


class VllmQwen2ForCausalLM(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.model = Qwen2Model(hf)
        self.lm_head = ParallelLMHead(hf.lm_head.weight)
        self.logits_processor = LogitsProcessor()

    def forward(self, ids, positions):
        return self.logits_processor(self.lm_head, self.model(ids, positions))


def plant(model: nn.Module, name: str, when: str, row: int, scale: float, on=lambda: True) -> None:
    """MODULE's output times 1+SCALE: in one-token forwards (decode), or on prefill rows >= ROW;
    only while ON() says so (one model serves several variants)."""
    module = model.get_submodule(name)
    inner = module.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        if not on():
            return out
        if when == "decode" and out.shape[0] == 1:
            return out * (1 + scale)
        if when == "prefill" and out.shape[0] > 1:
            factor = torch.ones(out.shape[0], *([1] * (out.dim() - 1)), dtype=out.dtype)
            factor[row:] = 1 + scale
            return out * factor
        return out

    module.forward = forward


def _variants(a: argparse.Namespace) -> list[dict]:
    """--variants JSON, or the one run the other flags describe (name None: straight into OUT)."""
    if a.variants:
        return json.loads(a.variants)
    one = {"name": None, "plant": a.plant, "when": a.when, "row": a.row, "scale": a.scale, "dump": a.dump}
    return [{**one, "flip": a.flip, "prompt_only": a.prompt_only}]


def _sort_steps(out: str, names: list[str | None]) -> None:
    """msprobe numbered the steps of every variant in one sequence: OUT/step{g} -> OUT/NAME/step{k}."""
    counts: dict[str, int] = {}
    for g, name in enumerate(names):
        if name is None:
            continue
        k = counts.get(name, 0)
        counts[name] = k + 1
        os.makedirs(os.path.join(out, name), exist_ok=True)
        os.rename(os.path.join(out, f"step{g}"), os.path.join(out, name, f"step{k}"))


def run_rollout(out: str, a: argparse.Namespace) -> None:
    rank, n = tp()
    if n > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=n)
    with torch.no_grad():
        model = VllmQwen2ForCausalLM(hf_model()).eval()
    variants = _variants(a)
    active = [0]
    for i, v in enumerate(variants):
        if v.get("plant"):
            on = lambda i=i: active[0] == i  # noqa: E731
            plant(model, v["plant"], v.get("when", "decode"), v.get("row", 0), v.get("scale", 0.01), on)
    dbg = standin.debugger(out, out)
    steps = [(PROMPT, list(range(len(PROMPT))))]
    steps += [([tok], [len(PROMPT) + k]) for k, tok in enumerate(RESPONSE[:-1])]
    names: list[str | None] = []
    for i, v in enumerate(variants):
        active[0] = i
        which = v.get("dump", "all")
        for number, (ids, positions) in enumerate(steps):
            dump = which == "all" or (which == "prefill") == (number == 0)
            if dump:
                dbg.start(model=model)
            with torch.no_grad():
                model(torch.tensor(ids), torch.tensor(positions))
            if dump:
                dbg.stop()
                dbg.step()
                names.append(v.get("name"))
    if n > 1:  # every rank's dumps are written before rank 0 moves the step folders they share
        import torch.distributed as dist

        dist.barrier()
        if rank:
            return
    _sort_steps(out, names)


def _hooks_module():
    """rl-msprobe's verl engine hook file (what `patch apply verl-engine` adds to verl), imported
    from the package: its PositionRecorder is what DUMP_POSITIONS=1 runs in the actor."""
    import importlib.util

    path = os.path.join(
        ROOT, "rl_msprobe", "patches", "files", "verl", "verl", "utils", "rl_msprobe_hooks.py"
    )
    spec = importlib.util.spec_from_file_location("rl_msprobe_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(model, ids: list[int], folder: str) -> None:
    """A per-token record of one forward, as the verl engine hook writes it (FOLDER/positions/...)."""
    os.makedirs(folder, exist_ok=True)
    config = os.path.join(folder, "config_actor.json")
    with open(config, "w") as handle:
        json.dump({"dump_path": folder}, handle)
    os.environ["MSPROBE_ACTOR_CONFIG"] = config
    recorder = _hooks_module().PositionRecorder(model, ["request-0"], 0)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    recorder.finish()


def run_train(out: str, a: argparse.Namespace) -> None:
    hf = hf_model()
    model = standin.fsdp_like(hf)
    variants = _variants(a)
    dbg = None if all(v.get("per_token") for v in variants) else standin.debugger(out, out)
    names: list[str | None] = []
    for v in variants:
        ids = list(PROMPT) if v.get("prompt_only") else PROMPT + RESPONSE
        if v.get("flip") is not None:
            ids[v["flip"]] = (ids[v["flip"]] + 1) % 512
        if v.get("per_token"):  # the hook's record instead of an msprobe step
            _record(model, ids, os.path.join(out, v["name"]))
            continue
        dbg.start(model=model)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        dbg.stop()
        dbg.step()
        names.append(v.get("name"))
    _sort_steps(out, names)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["rollout", "train"])
    p.add_argument("out")
    p.add_argument("--plant", help="rollout: module name to perturb, e.g. model.layers.1.mlp.down_proj")
    p.add_argument("--when", choices=["decode", "prefill"], default="decode")
    p.add_argument("--row", type=int, default=0, help="prefill plant: first prompt row perturbed")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument(
        "--dump", choices=["all", "prefill", "decode"], default="all", help="rollout: the steps dumped"
    )
    p.add_argument("--flip", type=int, help="train: change the token id at this position")
    p.add_argument(
        "--prompt-only", action="store_true", help="train: the prompt alone (what PROMPTS_ONLY runs)"
    )
    p.add_argument(
        "--variants",
        help='JSON list of runs in one process, e.g. [{"name": "clean"}, {"name": "p", "plant": MODULE, '
        '"when": "decode"}] (train: "flip", "prompt_only"): each into OUT/NAME/step{k}',
    )
    a = p.parse_args()
    (run_rollout if a.side == "rollout" else run_train)(a.out, a)


if __name__ == "__main__":
    main()

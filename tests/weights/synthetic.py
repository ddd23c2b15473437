"""A weights folder as a TP-sharded engine would write it, made from random tensors with the
job-side helper's own fingerprints: the layouts of vLLM (fused qkv_proj / gate_up_proj split by
partition sizes, row- and column-sharded linears, replicated norms, padded vocab rows dropped,
tied lm_head), with faults on request. Test data for compare, not a stand-in for the live job."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.weights.helper import load

helper = load()


def model(seed: int = 0, layers: int = 2, hidden: int = 16, heads: int = 4, kv: int = 2, vocab: int = 40):
    g = torch.Generator().manual_seed(seed)
    head = hidden // heads
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        out[p + "self_attn.q_proj.weight"] = torch.randn(heads * head, hidden, generator=g)
        out[p + "self_attn.k_proj.weight"] = torch.randn(kv * head, hidden, generator=g)
        out[p + "self_attn.v_proj.weight"] = torch.randn(kv * head, hidden, generator=g)
        out[p + "self_attn.o_proj.weight"] = torch.randn(hidden, heads * head, generator=g)
        out[p + "mlp.gate_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g)
        out[p + "mlp.up_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g)
        out[p + "mlp.down_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
    out["model.norm.weight"] = torch.randn(hidden, generator=g)
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied
    return out


def _shard(name: str, t: torch.Tensor, rank: int, tp: int, kv: int) -> torch.Tensor:
    if t.dim() == 1:
        return t  # norms: replicated
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return t.chunk(tp, dim=1)[rank]  # row parallel: the input dimension
    if name.endswith(("k_proj.weight", "v_proj.weight")) and tp > kv:
        return t.chunk(kv)[rank * kv // tp]  # a KV head replicated over tp / kv ranks
    return t.chunk(tp, dim=0)[rank]


def _line(stage: str, sync: int, rank: int, name: str, t: torch.Tensor, index: int, **extra) -> str:
    doc = {
        "stage": stage,
        "sync": sync,
        "rank": rank,
        "index": index,
        "name": name,
        "dtype": str(t.dtype)[6:],
        "shape": list(t.shape),
        "fp": helper.fingerprint(t),
        **extra,
    }
    return json.dumps(doc) + "\n"


def write(
    folder: Path,
    syncs: int = 2,
    tp: int = 2,
    kv: int = 2,
    faults=(),
    drop_sent=(),
    seed: int = 0,
    reset=(),
    kept=(),
) -> Path:
    """faults: (sync, stage, name, rank or None, factor); stage 'received' or 'resident'.
    reset: the syncs in reset mode (each resident record says `reset_kept`); kept: (sync, name,
    rank) whose part the loader never wrote in a reset sync (it holds the pattern)."""
    folder.mkdir(parents=True, exist_ok=True)
    for sync in range(1, syncs + 1):
        weights = model(seed + sync, kv=kv)
        sent = [(n, t) for n, t in weights.items() if n not in drop_sent]
        with (folder / "sent-host-100.jsonl").open("a") as out:
            for i, (n, t) in enumerate(sent):
                out.write(_line("sent", sync, 0, n, t, i, step=sync - 1, hash=helper.digest(t)))
        for rank in range(tp):
            pid = 200 + rank
            got = []
            for n, t in sent:
                for s, stage, name, r, factor in faults:
                    if (s, stage, name) == (sync, "received", n) and r in (None, rank):
                        t = t * factor
                got.append((n, t))
            with (folder / f"received-host-{pid}.jsonl").open("a") as out:
                for i, (n, t) in enumerate(got):
                    shards = {"shard_fp": helper._own_shards(t, rank, tp)} if tp > 1 else {}
                    out.write(
                        _line("received", sync, rank, n, t, i, tp_size=tp, hash=helper.digest(t), **shards)
                    )
            with (folder / f"resident-host-{pid}.jsonl").open("a") as out:
                loaded = dict(got)
                for n, t in (
                    (n, loaded.get(n, w)) for n, w in weights.items()
                ):  # unsent: the old value stays
                    if n == "lm_head.weight":
                        continue
                    for s, stage, name, r, factor in faults:
                        if (s, stage, name) == (sync, "resident", n) and r in (None, rank):
                            t = t * factor
                    how = "parameter" if t.dim() == 1 else "loader-written"
                    extra = {"reset_kept": (sync, n, rank) in kept} if sync in reset else {}
                    if extra.get("reset_kept"):
                        t = torch.full_like(t, helper.PATTERN)
                    out.write(
                        _line(
                            "resident",
                            sync,
                            rank,
                            n,
                            _shard(n, t, rank, tp, kv),
                            -1,
                            tp_size=tp,
                            how=how,
                            **extra,
                        )
                    )
                meta = {
                    "stage": "resident-meta",
                    "sync": sync,
                    "rank": rank,
                    "tp_size": tp,
                    "aliases": {"lm_head.weight": "model.embed_tokens.weight"},
                }
                out.write(json.dumps(meta) + "\n")
    return folder

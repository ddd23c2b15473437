"""Reading + comparing per-token records (rl_msprobe/dumps/records.py, record_compare.py) at a size
that matters: a synthetic record set, LAYERS decoder layers of Qwen2's modules (vLLM names on the
rollout, HF names on the trainer), REQUESTS requests of TOKENS positions, the rollout as one prefill
forward then one forward per decode step holding every request, the trainer one packed forward.

    python benchmarks/bench_records.py [layers tokens requests prompt]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rl_msprobe.dumps import record_compare, records

HIDDEN = 64
ROLLOUT = [  # (module under the layer, class, [(label, width)])
    ("input_layernorm", "RMSNorm", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn.qkv_proj", "QKVParallelLinear", [("input.0", HIDDEN), ("output.0", 3 * HIDDEN)]),
    ("self_attn.o_proj", "RowParallelLinear", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn", "Qwen2Attention", [("output.0", HIDDEN)]),
    ("post_attention_layernorm", "RMSNorm", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("mlp.gate_up_proj", "MergedColumnParallelLinear", [("input.0", HIDDEN), ("output.0", 4 * HIDDEN)]),
    ("mlp.act_fn", "SiluAndMul", [("input.0", 4 * HIDDEN), ("output.0", 2 * HIDDEN)]),
    ("mlp.down_proj", "RowParallelLinear", [("input.0", 2 * HIDDEN), ("output.0", HIDDEN)]),
    ("mlp", "Qwen2MLP", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
]
TRAIN = [
    ("input_layernorm", "Qwen2RMSNorm", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn.q_proj", "Linear", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn.k_proj", "Linear", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn.v_proj", "Linear", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn.o_proj", "Linear", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("self_attn", "Qwen2Attention", [("output.0", HIDDEN)]),
    ("post_attention_layernorm", "Qwen2RMSNorm", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
    ("mlp.gate_proj", "Linear", [("input.0", HIDDEN), ("output.0", 2 * HIDDEN)]),
    ("mlp.up_proj", "Linear", [("input.0", HIDDEN), ("output.0", 2 * HIDDEN)]),
    ("mlp.act_fn", "SiLU", [("input.0", 2 * HIDDEN), ("output.0", 2 * HIDDEN)]),
    ("mlp.down_proj", "Linear", [("input.0", 2 * HIDDEN), ("output.0", HIDDEN)]),
    ("mlp", "Qwen2MLP", [("input.0", HIDDEN), ("output.0", HIDDEN)]),
]


def tensors(table: list, layers: int, cls_embed: str) -> list[tuple[str, str, int, str]]:
    out = [(f"Module.model.embed_tokens.{cls_embed}.forward.0", "input.0", 1, "torch.int64")]
    out.append((f"Module.model.embed_tokens.{cls_embed}.forward.0", "output.0", HIDDEN, "torch.bfloat16"))
    for n in range(layers):
        for name, cls, labels in table:
            out += [
                (f"Module.model.layers.{n}.{name}.{cls}.forward.0", lab, w, "torch.bfloat16")
                for lab, w in labels
            ]
    out.append(("Module.model.norm.RMSNorm.forward.0", "output.0", HIDDEN, "torch.bfloat16"))
    return out


def stats(rng, ids, width: int, rows: int) -> np.ndarray:
    """Max, Min, Norm rows of a tensor that depends only on the token (the same on both sides)."""
    if width == 1:
        return np.stack([ids, ids, np.abs(ids)]).astype("<f4")
    base = (
        np.sin(ids[None, :] * (np.arange(3)[:, None] + 1.0))
        + np.array([[2.0], [-2.0], [5.0]]) * width**0.5 / 8
    )
    return base.astype("<f4")


def write(
    folder: Path, side: str, k: int, tensors_: list, segments: list, ids: np.ndarray, phase: str
) -> None:
    rows = sum(c for _, _, c in segments)
    header = {
        "format": records.FORMAT,
        "side": side,
        "pid": 1,
        "forward": k,
        "rank": 0,
        "tp_rank": 0,
        "tp_size": 1,
        "phase": phase,
        "engine": "bench",
        "requests": [f"r{i}" for i in range(len(segments))],
        "token_rows": [[i, first, count] for i, (_, first, count) in enumerate(segments)],
        "sample_rows": [],
        "schema": 0,  # the tensor table once per process, as the helper writes it
    }
    table = folder / "schema0.json"
    if not table.exists():
        folder.mkdir(parents=True, exist_ok=True)
        rows_ = [
            {"key": key, "label": lab, "dtype": dt, "width": w, "rows": "token"}
            for key, lab, w, dt in tensors_
        ]
        table.write_text(json.dumps({"format": records.FORMAT, "schema": 0, "tensors": rows_}))
    data = np.concatenate([stats(None, ids, w, rows).reshape(-1) for _, _, w, _ in tensors_])
    folder.mkdir(parents=True, exist_ok=True)
    data.astype("<f4").tofile(folder / f"rec{k}.f32")
    (folder / f"rec{k}.json").write_text(json.dumps(header))


def main(layers: int = 28, tokens: int = 2048, requests: int = 4, prompt: int = 256) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 150000, tokens).astype(np.float64) for _ in range(requests)]
    rt, tt = tensors(ROLLOUT, layers, "VocabParallelEmbedding"), tensors(TRAIN, layers, "Embedding")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        write(
            root / "rollout/1",
            "rollout",
            0,
            rt,
            [(i, 0, prompt) for i in range(requests)],
            np.concatenate([s[:prompt] for s in seqs]),
            "prefill",
        )
        for k, p in enumerate(range(prompt, tokens - 1), 1):
            write(
                root / "rollout/1",
                "rollout",
                k,
                rt,
                [(i, p, 1) for i in range(requests)],
                np.array([s[p] for s in seqs]),
                "decode",
            )
        write(
            root / "train/2",
            "train",
            0,
            tt,
            [(i, 0, tokens) for i in range(requests)],
            np.concatenate(seqs),
            "train",
        )
        print(f"wrote {tokens - prompt} rollout records + 1 training record in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        job = record_compare.compare_job(records.find([root]) or {})
        seconds = time.monotonic() - t0
        print(
            f"{layers} layers, {tokens} tokens, {requests} requests: {len(rt)} rollout / {len(tt)} training tensors "
            f"per token; records {job.sizes['rollout'] / 2**20:.1f} MiB + {job.sizes['train'] / 2**20:.1f} MiB; "
            f"read + compared in {seconds:.2f} s"
        )
        for r in job.results:
            print(" ", r.request_id, r.verdict()[:150], f"({r.seconds:.2f} s)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))

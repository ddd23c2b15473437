"""Real per-token records from a tiny torch model, written by the shared helper
(rl_msprobe/patches/files/common/rl_msprobe_records.py), for tests/dumps/test_records.py and
test_record_compare.py.

Two models with one set of weights, as the two engines name them: the trainer's (Hugging Face
names: q/k/v_proj, gate/up_proj, act_fn = SiLU, lm_head) and the rollout's (vLLM names and
classes: QKVParallelLinear qkv_proj, MergedColumnParallelLinear gate_up_proj, SiluAndMul,
RowParallelLinear, logits_processor on the sampled rows only). The rollout runs at TP = 1 or as
two TP "ranks" (two Recorders, tp_rank 0 / 1): column-parallel modules compute their shard,
row-parallel ones take their shard of the input and give the all-reduced output. Every row's
computation is its own (no attention across positions), so any split of the batch gives the same
rows: packed requests, chunked prefill, one forward per position.

`write_job` runs a schedule: the rollout's forwards (each a list of (request, first position,
count) segments: prefills, decode steps, mixed) and the training forwards (packed requests), with
plants: (side, module, request, position, TP rank or None) x 1.01 on that row of that output.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

HELPER = Path(__file__).resolve().parents[2] / "rl_msprobe/patches/files/common/rl_msprobe_records.py"
HIDDEN, INTER, VOCAB, LAYERS = 8, 12, 40, 2


def helper():
    spec = importlib.util.spec_from_file_location("rl_msprobe_records_for_compare", HELPER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Weights:
    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * 0.3

        self.embed = w(VOCAB, HIDDEN)
        self.layers = [
            {
                "q": w(HIDDEN, HIDDEN),
                "k": w(HIDDEN, HIDDEN),
                "v": w(HIDDEN, HIDDEN),
                "o": w(HIDDEN, HIDDEN),
                "gate": w(INTER, HIDDEN),
                "up": w(INTER, HIDDEN),
                "down": w(HIDDEN, INTER),
            }
            for _ in range(LAYERS)
        ]
        self.head = w(VOCAB, HIDDEN)


# ------------------------------------------------------------------ the trainer's model (HF names)
class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Norm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()


class SiLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)


class Embedding(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class TrainAttention(torch.nn.Module):
    """HF's attention; on TP rank RANK of SIZE (Megatron's names kept as HF's here): q / k / v
    column shards, o_proj row-parallel (its input this rank's shard, its output all-reduced)."""

    def __init__(self, w: dict, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.w, self.size = w, size
        self.q_proj, self.k_proj, self.v_proj = (Linear(_shard(w[k], rank, size, 0)) for k in "qkv")
        self.o_proj = Linear(w["o"]) if size == 1 else RowParallelLinear(w["o"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.q_proj(x) * self.k_proj(x) + self.v_proj(x)
        if self.size > 1:
            self.o_proj.full = (x @ self.w["q"].T) * (x @ self.w["k"].T) + x @ self.w["v"].T
        return self.o_proj(shard)


class TrainMLP(torch.nn.Module):
    def __init__(self, w: dict, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.w, self.size = w, size
        self.gate_proj, self.up_proj = (
            Linear(_shard(w["gate"], rank, size, 0)),
            Linear(_shard(w["up"], rank, size, 0)),
        )
        self.down_proj = Linear(w["down"]) if size == 1 else RowParallelLinear(w["down"])
        self.act_fn = SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if self.size > 1:
            self.down_proj.full = torch.nn.functional.silu(x @ self.w["gate"].T) * (x @ self.w["up"].T)
        return self.down_proj(shard)


class TrainLayer(torch.nn.Module):
    def __init__(self, w: dict, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
        self.self_attn, self.mlp = TrainAttention(w, rank, size), TrainMLP(w, rank, size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class TrainInner(torch.nn.Module):
    def __init__(self, ws: Weights, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = Embedding(ws.embed)
        self.layers = torch.nn.ModuleList(TrainLayer(w, rank, size) for w in ws.layers)
        self.norm = Norm()


class TrainModel(torch.nn.Module):
    def __init__(self, ws: Weights, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.model = TrainInner(ws, rank, size)
        self.lm_head = Linear(ws.head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [1, tokens] (packed)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


# ------------------------------------------------------------------ the rollout's model (vLLM names)
def _shard(w: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    return w.chunk(size, dim=dim)[rank]


class QKVParallelLinear(Linear):
    pass


class MergedColumnParallelLinear(Linear):
    pass


class RowParallelLinear(torch.nn.Module):
    """Takes this rank's shard of the input; gives the all-reduced output (the full product, from the
    full input its parent hands over beside the shard)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.full: torch.Tensor | None = None

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        assert self.full is not None
        return self.full @ self.weight.T


class SiluAndMul(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u


class VocabParallelEmbedding(Embedding):
    pass


class RMSNorm(Norm):
    pass


class LogitsProcessor(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


class RolloutAttention(torch.nn.Module):
    def __init__(self, w: dict, rank: int, size: int) -> None:
        super().__init__()
        self.w, self.rank, self.size = w, rank, size
        qkv = torch.cat([_shard(w[k], rank, size, 0) for k in "qkv"])
        self.qkv_proj = QKVParallelLinear(qkv)
        self.o_proj = RowParallelLinear(w["o"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        full = (x @ self.w["q"].T) * (x @ self.w["k"].T) + x @ self.w["v"].T
        self.o_proj.full = full
        return self.o_proj(q * k + v)


class RolloutMLP(torch.nn.Module):
    def __init__(self, w: dict, rank: int, size: int) -> None:
        super().__init__()
        self.w = w
        self.gate_up_proj = MergedColumnParallelLinear(
            torch.cat([_shard(w["gate"], rank, size, 0), _shard(w["up"], rank, size, 0)])
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(w["down"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.act_fn(self.gate_up_proj(x))
        self.down_proj.full = torch.nn.functional.silu(x @ self.w["gate"].T) * (x @ self.w["up"].T)
        return self.down_proj(shard)


class RolloutLayer(torch.nn.Module):
    def __init__(self, w: dict, rank: int, size: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.self_attn, self.mlp = RolloutAttention(w, rank, size), RolloutMLP(w, rank, size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class RolloutInner(torch.nn.Module):
    def __init__(self, ws: Weights, rank: int, size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(ws.embed)
        self.layers = torch.nn.ModuleList(RolloutLayer(w, rank, size) for w in ws.layers)
        self.norm = RMSNorm()


class RolloutModel(torch.nn.Module):
    def __init__(self, ws: Weights, rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.model = RolloutInner(ws, rank, size)
        self.logits_processor = LogitsProcessor(ws.head)

    def forward(self, ids: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:  # ids [tokens]
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.logits_processor(self.model.norm(h)[sample_rows])


# ------------------------------------------------------------------ a job
@dataclass(frozen=True)
class Plant:
    side: str  # rollout | train
    module: str  # model.layers.1.mlp.down_proj
    request: str
    position: int
    tp_rank: int | None = None  # only this TP rank of its side (None: every rank)


def batched_schedule(
    lengths: dict[str, tuple[int, int]], chunk: int | None = None
) -> list[list[tuple[str, int, int]]]:
    """A vLLM-like schedule: requests start one forward apart, each prefill (in chunks of CHUNK
    rows when given) then one decode row per forward, up to position P+R-2 (the last response
    token is never fed back); forwards hold several requests, prefill and decode mixed."""
    todo = {rid: 0 for rid in lengths}
    start = {rid: i for i, rid in enumerate(lengths)}
    out, step = [], 0
    while any(todo[r] < p + n - 1 for r, (p, n) in lengths.items()):
        forward = []
        for rid, (p, n) in lengths.items():
            at = todo[rid]
            if step < start[rid] or at >= p + n - 1:
                continue
            count = (min(p - at, chunk) if chunk else p - at) if at < p else 1
            forward.append((rid, at, count))
            todo[rid] = at + count
        out.append(forward)
        step += 1
    return out


def per_position_schedule(lengths: dict[str, tuple[int, int]]) -> list[list[tuple[str, int, int]]]:
    """One forward per position of each request (prompt too)."""
    return [[(rid, q, 1)] for rid, (p, n) in lengths.items() for q in range(p + n - 1)]


def _plant_hooks(
    model: torch.nn.Module, plants: list[Plant], rows: dict[tuple[str, int], int], rank: int | None
):
    handles = []
    names = dict(model.named_modules())
    for plant in plants:
        if (plant.request, plant.position) not in rows or (
            plant.tp_rank is not None and plant.tp_rank != rank
        ):
            continue
        row = rows[(plant.request, plant.position)]

        def hook(module, args, output, row=row):
            out = output.clone()
            out.reshape(-1, out.shape[-1])[row] *= 1.01
            return out

        handles.append(names[plant.module].register_forward_hook(hook))
    return handles


def write_job(
    root: Path,
    tokens: dict[str, list[int]],
    prompts: dict[str, int],
    rollout: list[list[tuple[str, int, int]]],
    train: list[list[str]],
    tp: int = 1,
    plants: tuple[Plant, ...] = (),
    train_tokens: dict[str, list[int]] | None = None,
    train_tp: int = 1,
) -> Path:
    """Records of one job under ROOT (RL_MSPROBE_RECORD_DIR): the rollout's forwards (ROLLOUT) on
    TP ranks, the training forwards (TRAIN: request ids packed per forward). TOKENS: each request's
    prompt + response ids; TRAIN_TOKENS: the training side's, when they differ."""
    import os

    rec = helper()
    ws = Weights()
    old = os.environ.get(rec.ENV_DIR)
    os.environ[rec.ENV_DIR] = str(root)
    try:
        rec._counters.clear()
        rec._schemas.clear()
        rollout_models = [RolloutModel(ws, r, tp) for r in range(tp)]
        for rank, model in enumerate(rollout_models):
            # each TP rank its own process: records under its own pid folder
            folder = root / "rollout" / str(1000 + rank)
            for k, forward in enumerate(rollout):
                ids, segments, samples, rows, sample_rows = [], [], [], {}, []
                for rid, first, count in forward:
                    segments.append((f"{rid}-0123abcd", len(ids), first, count))
                    for q in range(first, first + count):
                        rows[(rid, q)] = len(ids)
                        ids.append(tokens[rid][q])
                    samples.append((rid, len(samples), first + count - 1))
                    sample_rows.append(len(ids) - 1)
                layout = rec.Layout(len(ids), segments, samples, num_samples=len(samples))
                hooks = _plant_hooks(model, [p for p in plants if p.side == "rollout"], rows, rank)
                recorder = rec.Recorder(
                    model,
                    layout,
                    "rollout",
                    {"rank": rank, "tp_rank": rank, "tp_size": tp, "phase": "mixed", "engine": "vllm-v1"},
                )
                with torch.no_grad():
                    model(torch.tensor(ids), torch.tensor(sample_rows))
                path = recorder.finish()
                for h in hooks:
                    h.remove()
                assert path is not None
                _move(Path(path), folder, k)
        for t_rank in range(train_tp):  # Megatron: each TP rank its own process
            model = TrainModel(ws, t_rank, train_tp)
            folder = root / "train" / str(2000 + t_rank)
            engine = "verl-fsdp" if train_tp == 1 else "verl-megatron"
            for k, packed in enumerate(train):
                ids, segments, rows = [], [], {}
                for rid in packed:
                    seq = (train_tokens or tokens)[rid]
                    segments.append((rid, len(ids), 0, len(seq)))
                    for q in range(len(seq)):
                        rows[(rid, q)] = len(ids) + q
                    ids += seq
                layout = rec.Layout(len(ids), segments)
                train_plants = [p for p in plants if p.side == "train"]
                hooks = _plant_hooks(model, train_plants, rows, t_rank if train_tp > 1 else None)
                recorder = rec.Recorder(
                    model,
                    layout,
                    "train",
                    {
                        "rank": t_rank,
                        "tp_rank": t_rank,
                        "tp_size": train_tp,
                        "phase": "train",
                        "engine": engine,
                    },
                )
                with torch.no_grad():
                    model(torch.tensor(ids)[None])
                path = recorder.finish()
                for h in hooks:
                    h.remove()
                assert path is not None
                _move(Path(path), folder, k)
    finally:
        if old is None:
            os.environ.pop(rec.ENV_DIR, None)
        else:
            os.environ[rec.ENV_DIR] = old
    return root


def _move(header: Path, folder: Path, k: int) -> None:
    """The helper writes under this test process's pid: move the record to the folder of the process it
    stands for (its `pid` left as written)."""
    import json
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    schema = f"schema{json.loads(header.read_text())['schema']}.json"  # its tensor table goes along
    if not (folder / schema).exists():
        shutil.copyfile(header.parent / schema, folder / schema)
    header.with_suffix(".f32").rename(folder / f"rec{k}.f32")
    header.rename(folder / f"rec{k}.json")


def tokens_of(lengths: dict[str, tuple[int, int]], seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(0, VOCAB, (p + n,), generator=g).tolist() for rid, (p, n) in lengths.items()}

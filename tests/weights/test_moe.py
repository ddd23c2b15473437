"""MoE experts per expert: an engine's stacked expert weights (vLLM FusedMoE `w13_weight` [E, 2I, H],
`w2_weight` [E, H, I], TP-sharded along I) are fingerprinted per expert and projection under the
names the trainer sends (`mlp.experts.{e}.gate_proj.weight` ...), and a fault names the layer, the
expert and the projection, at a sync and against the checkpoint.

The engine here is a torch module with vLLM 0.32's expert state (`RoutedExperts` under
`mlp.experts.routed_experts`, `layer_name`, the `ckpt_*_proj_name`s) filled as vLLM's FusedMoE
weight loader fills it (`_load_w13`: this rank's 1/TP rows of gate into the first half of the
expert's w13 rows, of up into the second; `_load_w2`: its 1/TP columns of down), read from vLLM
0.32.0's routed_experts.py. The helper is the job-side file itself; TP ranks run one after the
other in this process, each with its own copy of the helper (its own sync counter) and its
(rank, TP size) given to it, as vLLM's parallel state would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rl_msprobe.weights.checkpoint import compare_checkpoint, read_checkpoint
from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.experts import expert_of
from rl_msprobe.weights.records import read_run
from tests.support.trees import run_cli
from tests.weights.helper import load, vllm_worker
from tests.weights.test_checkpoint import write_safetensors

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 8, 6
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def trainer_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """What verl sends for a Qwen3-MoE: per-expert tensors (its `unfuse_moe_params` splits
    Transformers 5's packed experts into these), the router and a norm."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp."
        out[p + "gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g)
        for e in range(EXPERTS):
            out[p + f"experts.{e}.gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
            out[p + f"experts.{e}.up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
            out[p + f"experts.{e}.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=g)
    out["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    return out


class RoutedExperts(torch.nn.Module):
    """vLLM 0.32's expert state of one layer on one TP rank (what the helper reads)."""

    ckpt_gate_proj_name, ckpt_up_proj_name, ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"

    def __init__(self, layer_name: str, tp: int, rank: int) -> None:
        super().__init__()
        self.layer_name, self.tp, self.rank = layer_name, tp, rank
        shard = INTER // tp
        self.w13_weight = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * shard, HIDDEN), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN, shard), requires_grad=False)

    def load(self, expert: int, projection: str, loaded: torch.Tensor) -> None:
        """FusedMoE's weight loader for one expert's tensor (shard ids w1 / w3 / w2)."""
        shard = INTER // self.tp
        if projection == "down_proj":
            self.w2_weight.data[expert].copy_(loaded.narrow(1, self.rank * shard, shard))
            return
        half = 0 if projection == "gate_proj" else shard
        rows = loaded.narrow(0, self.rank * shard, shard)
        self.w13_weight.data[expert].narrow(0, half, shard).copy_(rows)


class MoEModel(torch.nn.Module):
    def __init__(self, tp: int, rank: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for layer in range(LAYERS):
            block = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.mlp.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)  # the router: replicated
            block.mlp.experts = torch.nn.Module()
            block.mlp.experts.routed_experts = RoutedExperts(f"model.layers.{layer}.mlp.experts", tp, rank)
            self.model.layers.append(block)
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)

    def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                parts = name.split(".")
                if ".experts." in name:
                    layer, expert, projection = int(parts[2]), int(parts[5]), parts[6]
                    self.model.layers[layer].mlp.experts.routed_experts.load(expert, projection, tensor)
                else:
                    self.get_parameter(name).copy_(tensor)
        self.fault()  # a test's loader fault: none by default

    def fault(self) -> None:
        pass


def sync_folder(
    folder: Path, monkeypatch, tp: int, send=None, fault=None, weights=None
) -> dict[str, torch.Tensor]:
    """One sync: the trainer's tensors fingerprinted as sent, then each TP rank's worker receives
    and loads them; FAULT(rank, model) edits a rank's loaded weights before the sync returns.
    Files are laid out per process, as a job writes them. Returns what was sent."""
    weights = weights or trainer_weights()
    sent_names = send or list(weights)
    folder.mkdir(parents=True, exist_ok=True)
    actor = load()
    monkeypatch.setenv(actor.ENV, str(folder / "actor"))
    tensors = list(actor.sent(iter([(n, weights[n]) for n in sent_names]), 0))
    for rank in range(tp):
        helper = load()
        monkeypatch.setattr(helper, "_tp", lambda rank=rank: (rank, tp))
        monkeypatch.setenv(helper.ENV, str(folder / f"rank{rank}"))
        model = MoEModel(tp, rank)

        if fault is not None:
            model.fault = lambda model=model, rank=rank: fault(rank, model)
        vllm_worker(helper, model).update_weights_from_ipc(tensors)
    for path in sorted(folder.glob("*/*.jsonl")):  # one pid per process: the actor, each TP rank
        stage, process = path.name.split("-")[0], path.parent.name
        pid = 99 if process == "actor" else 100 + int(process.removeprefix("rank"))
        shutil.move(path, folder / f"{stage}-host-{pid}.jsonl")
    return dict(tensors)


@pytest.mark.parametrize("tp", [1, 2])
def test_stacked_experts_split_back_into_the_trainer_s_tensors(tp):
    helper = load()
    weights = trainer_weights()
    for rank in range(tp):
        model = MoEModel(tp, rank)
        model.load_weights(weights.items())
        experts = model.model.layers[1].mlp.experts.routed_experts
        module = "model.layers.1.mlp.experts.routed_experts"
        parts = [
            *helper._parts(model, module, experts, "w13_weight", experts.w13_weight),
            *helper._parts(model, module, experts, "w2_weight", experts.w2_weight),
        ]
        expected = [
            f"model.layers.1.mlp.experts.{e}.{p}.weight"
            for e in range(EXPERTS)
            for p in ("gate_proj", "up_proj")
        ] + [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(EXPERTS)]
        assert [n for n, _ in parts] == expected
        shard = INTER // tp
        for name, part in parts:
            whole = weights[name]
            dim = 1 if name.endswith("down_proj.weight") else 0
            assert torch.equal(part, whole.narrow(dim, rank * shard, shard)), name


def test_expert_parallel_ranks_and_mixtral_names_are_taken_from_the_layer():
    """Under expert parallelism `expert_map` (global -> local, -1 elsewhere) gives each local slice
    its global expert id; Mixtral's layer names its projections w1 / w3 / w2; a layer that is not
    gated holds one projection in w13; a 2-D `w2_weight` is no stacked expert weight."""
    helper = load()
    layer = RoutedExperts("model.layers.0.block_sparse_moe.experts", 1, 0)
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = "w1", "w3", "w2"
    layer.register_buffer("expert_map", torch.tensor([-1, -1, 1, 0]))  # this rank holds 3 and 2
    module = "model.layers.0.block_sparse_moe.experts.routed_experts"
    w13 = torch.arange(2.0 * 2 * INTER * HIDDEN).reshape(2, 2 * INTER, HIDDEN)
    names = [n for n, _ in helper._parts(None, module, layer, "w13_weight", w13)]
    assert names == [
        f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight" for e in (3, 2) for p in ("w1", "w3")
    ]
    ((name, part), *_) = helper._parts(None, module, layer, "w13_weight", w13)
    assert torch.equal(part, w13[0, :INTER])  # local slice 0 is global expert 3
    layer.moe_config = type("Config", (), {"is_act_and_mul": False})()
    plain = [(n, p.shape) for n, p in helper._parts(None, module, layer, "w13_weight", w13[:, :INTER])]
    assert plain == [
        (f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight", (INTER, HIDDEN)) for e in (3, 2)
    ]
    flat = torch.nn.Module()
    assert [n for n, _ in helper._parts(None, "mlp", flat, "w2_weight", torch.ones(3, 4))] == [
        "mlp.w2_weight"
    ]


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unchanged_moe_sync_is_equal_per_expert(tmp_path, monkeypatch, tp):
    sent = sync_folder(tmp_path / "w", monkeypatch, tp)
    doc = compare_run(read_run(tmp_path / "w"))
    (step,) = doc["steps"]
    assert doc["verdict"] == "EQUAL" and step["tp_size"] == tp, step
    assert step["sent_tensors"] == step["model_tensors"] == len(sent) == LAYERS * (1 + 3 * EXPERTS) + 1
    experts = [r for r in doc["tensors"] if "expert" in r]
    assert len(experts) == LAYERS * EXPERTS * 3 * 1 and all(
        r["resident"]["status"] == "equal" for r in experts
    )
    if tp == 1:  # identical bytes: the resident statistics are the received ones
        assert step["resident_reused"] == len(sent)


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_one_expert_s_up_proj_changed_by_the_loader_is_named(tmp_path, monkeypatch, tp, rank):
    """A loader fault in expert 2's up rows of layer 1 on one rank: that expert's up_proj differs at
    stage resident, on that rank; its gate_proj (the same w13 slice) and every other tensor are equal."""
    shard = INTER // tp

    def fault(r, model):
        if r == rank:
            model.model.layers[1].mlp.experts.routed_experts.w13_weight.data[2, shard, 0] += 1.0

    sync_folder(tmp_path / "w", monkeypatch, tp, fault=fault)
    doc = compare_run(read_run(tmp_path / "w"))
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    first = doc["first_difference"]
    assert doc["verdict"] == "DIFFERENT" and first["name"] == name and first["stage"] == "resident", first
    assert first["expert"] == {"layer": 1, "expert": 2, "projection": "up_proj"}
    assert first.get("faulty_ranks") == [rank], first
    differs = [
        r["name"] for r in doc["tensors"] if "differs" in (r["received"]["status"], r["resident"]["status"])
    ]
    assert differs == [name]
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"), "--out", str(tmp_path / "report"))
    assert code == 1 and f"{name} (layer 1, expert 2, up_proj)" in out, out
    markdown = (tmp_path / "report" / "weights.md").read_text()
    assert f"`{name}` (layer 1, expert 2, up_proj) resident: differs" in markdown, markdown


def test_an_expert_the_sync_never_sent_is_not_synced_by_expert(tmp_path, monkeypatch):
    """The mapping forgets expert 3's down_proj of layer 0: each rank holds it, received other
    tensors and not this one: NOT SYNCED, by name, shape and rank."""
    missing = "model.layers.0.mlp.experts.3.down_proj.weight"
    sync_folder(tmp_path / "w", monkeypatch, 2, send=[n for n in trainer_weights() if n != missing])
    doc = compare_run(read_run(tmp_path / "w"))
    assert doc["verdict"] == "DIFFERENT"
    (unsynced,) = doc["not_synced"]
    assert (unsynced["name"], unsynced["shape"], unsynced["ranks"]) == (missing, [HIDDEN, INTER // 2], [0, 1])
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"))
    assert code == 1 and f"NOT SYNCED: {missing} (layer 0, expert 3, down_proj)" in out, out


@pytest.mark.parametrize("tp", [1, 2])
def test_the_checkpoint_against_the_engine_per_expert(tmp_path, monkeypatch, tp):
    """`weights compare --checkpoint`: per-expert safetensors (as Transformers 5 saves a Qwen3-MoE)
    against the engine's stacked experts: EQUAL unchanged; one expert's down_proj changed on disk is
    named with its layer and expert."""
    weights = trainer_weights()
    sync_folder(tmp_path / "w", monkeypatch, tp, weights=weights)
    write_safetensors(tmp_path / "ckpt" / "model.safetensors", weights)
    run = read_run(tmp_path / "w")
    doc = compare_checkpoint(run, read_checkpoint(tmp_path / "ckpt"))
    assert doc["verdict"] == "EQUAL" and doc["counts"] == {"equal": len(weights)}, doc["counts"]
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    write_safetensors(tmp_path / "ckpt" / "model.safetensors", {**weights, name: weights[name] * 1.01})
    doc = compare_checkpoint(run, read_checkpoint(tmp_path / "ckpt"))
    first = doc["first_difference"]
    assert doc["verdict"] == "DIFFERENT" and first["name"] == name, first
    assert first["expert"] == {"layer": 0, "expert": 1, "projection": "down_proj"}
    assert [r["name"] for r in doc["tensors"] if r["status"] == "differs"] == [name]
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"), "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 1 and f"first difference: {name} (layer 0, expert 1, down_proj)" in out, out


def test_expert_names_are_read_back_as_layer_expert_and_projection():
    assert expert_of("model.layers.11.mlp.experts.7.gate_proj.weight") == {
        "layer": 11,
        "expert": 7,
        "projection": "gate_proj",
    }
    assert expert_of("model.layers.3.block_sparse_moe.experts.0.w3.weight")["projection"] == "w3"
    for other in ("model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.experts.w13_weight"):
        assert expert_of(other) is None
    assert (
        json.dumps(expert_of("experts.2.down_proj.weight"))
        == '{"layer": null, "expert": 2, "projection": "down_proj"}'
    )

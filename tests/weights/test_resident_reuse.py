"""The resident stage reuses what was received where the bytes are identical: a part with the
received dtype and shape whose k64 checksum equals the received one gets the received statistics
(`"same_as": "received"`); any other part is measured, so a loader fault is still found by how much,
and a permutation (statistics equal) is now found by its checksum."""

from __future__ import annotations

import json

import torch

from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.fingerprint import Fingerprint, compare
from rl_msprobe.weights.records import read_run
from tests.weights.helper import load

NAMES = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "norm.weight", "embed.weight")


class _Repack:
    """A quant method that repacks a layer after loading (as vLLM CPU does: the parameter is then
    empty), so the helper fingerprints what the loader wrote just before it."""

    def process_weights_after_loading(self, layer):
        layer.weight.data = torch.empty(0)


class _Model(torch.nn.Module):
    """A vLLM-shaped model on one TP rank of TP: fused q|k|v split by output_partition_sizes
    (repacked after loading), a replicated norm, a vocab shard padded to 8 rows per rank."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, tensors: dict[str, torch.Tensor], tp: int = 1, rank: int = 0, dtype=torch.float32):
        super().__init__()
        self.tp, self.rank, self.dtype, self.faults = tp, rank, dtype, {}
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = torch.nn.Module()
        sizes = [tensors[n].shape[0] // tp for n in NAMES[:3]]
        self.attn.qkv_proj.weight = torch.nn.Parameter(torch.zeros(sum(sizes), 4, dtype=dtype), False)
        self.attn.qkv_proj.output_partition_sizes = sizes
        self.attn.qkv_proj.quant_method = _Repack()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(4, dtype=dtype), False)
        self.embed = torch.nn.Module()
        self.embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=dtype), False)
        rows = tensors["embed.weight"].shape[0] // tp
        self.embed.shard_indices = type("Indices", (), {"num_org_elements": rows})()

    def load_weights(self, named):
        qkv = self.attn.qkv_proj
        qkv.weight.data = torch.zeros(sum(qkv.output_partition_sizes), 4, dtype=self.dtype)  # after a repack
        offset = 0
        for name, t in named:
            t = self.faults.get(name, lambda x: x)(t.chunk(self.tp)[self.rank] if t.dim() > 1 else t)
            if name == "norm.weight":
                self.norm.weight.data.copy_(t)
            elif name == "embed.weight":
                self.embed.weight.data[: t.shape[0]] = t
            else:
                self.attn.qkv_proj.weight.data[offset : offset + t.shape[0]] = t
                offset += t.shape[0]
        self.attn.qkv_proj.quant_method.process_weights_after_loading(self.attn.qkv_proj)


def _tensors(seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {NAMES[0]: (4, 4), NAMES[1]: (2, 4), NAMES[2]: (2, 4), NAMES[3]: (4,), NAMES[4]: (6, 4)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def _sync(helper, model: _Model, tensors: dict[str, torch.Tensor], sync: int) -> None:
    """One sync as the vLLM worker extension runs it once patched (engine_sync, received, the
    loaders; the armed hook before the repack), on TP rank model.rank of model.tp."""

    class Worker:
        model_runner = type("Runner", (), {"model": model})()

        @helper.engine_sync
        def update_weights_from_ipc(self, named):
            helper.received(self, named)
            model.load_weights(named)

    helper._tp = lambda: (model.rank, model.tp)
    Worker().update_weights_from_ipc(list(helper.sent(iter(tensors.items()), sync)))


def _resident(folder, sync: int) -> dict[str, dict]:
    lines = [json.loads(x) for p in folder.glob("resident-*.jsonl") for x in p.read_text().splitlines()]
    return {x["name"]: x for x in lines if x["stage"] == "resident" and x["sync"] == sync}


def test_identical_parts_reuse_received_statistics_and_a_loader_fault_is_measured(tmp_path, monkeypatch):
    """TP 1: every part the loader wrote unchanged (fused slices, the norm, the vocab rows without
    their padding) reuses its received statistics, which are those of the part itself; a part the
    loader scaled (sync 2) or permuted (sync 3: statistics equal) is measured and named at stage
    resident, by how much and by its bits; the others are still reused."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    model = _Model(tensors)
    _sync(helper, model, tensors, 1)
    model.faults = {NAMES[1]: lambda t: t * 1.001}
    _sync(helper, model, tensors, 2)
    model.faults = {NAMES[2]: lambda t: t.flip(0)}
    _sync(helper, model, tensors, 3)

    first = _resident(tmp_path, 1)
    assert {n: first[n].get("same_as") for n in NAMES} == dict.fromkeys(NAMES, "received"), first
    assert first[NAMES[0]]["how"] == "loader-written" and first[NAMES[3]]["how"] == "parameter"
    for name, t in tensors.items():
        assert first[name]["hash"] == helper.digest(t)
        assert compare(
            Fingerprint.from_dict(helper.fingerprint(t)), Fingerprint.from_dict(first[name]["fp"])
        ).equal
    second, third = _resident(tmp_path, 2), _resident(tmp_path, 3)
    assert [n for n in NAMES if "same_as" not in second[n]] == [NAMES[1]]
    assert second[NAMES[1]]["fp"] == helper.fingerprint(tensors[NAMES[1]] * 1.001)
    assert second[NAMES[1]]["hash"] == helper.digest(tensors[NAMES[1]] * 1.001)
    assert [n for n in NAMES if "same_as" not in third[n]] == [NAMES[2]]

    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT", "DIFFERENT"], doc["steps"]
    assert [s["resident_reused"] for s in doc["steps"]] == [5, 4, 4]
    differs = {
        (r["sync"], r["name"], r["resident"].get("what"))
        for r in doc["tensors"]
        if r["resident"]["status"] == "differs"
    }
    assert {(s, n) for s, n, _ in differs} == {(2, NAMES[1]), (3, NAMES[2])}, differs
    assert (3, NAMES[2], "bits (hash differs, statistics equal in float64)") in differs
    assert all(r["received"]["status"] == "equal" for r in doc["tensors"])
    assert doc["first_difference"]["stage"] == "resident" and doc["first_difference"]["ratio"] > 1


def test_no_reuse_for_a_tp_shard_a_padded_vocab_shard_or_a_dtype_change(tmp_path, monkeypatch):
    """TP 2: the fused slices and the padded vocab rows are this rank's shards (another shape),
    measured; the replicated norm is a full copy, reused. A model holding bfloat16 of float32
    received: nothing reused. Each measured part's numbers are its own."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path / "tp2"))
    tensors = _tensors()
    model = _Model(tensors, tp=2, rank=1)
    _sync(helper, model, tensors, 1)
    held = _resident(tmp_path / "tp2", 1)
    assert [n for n in NAMES if held[n].get("same_as")] == [NAMES[3]], held
    for name in (NAMES[0], NAMES[4]):
        assert "hash" not in held[name]
        assert held[name]["fp"] == helper.fingerprint(tensors[name].chunk(2)[1])
    assert compare_run(read_run(tmp_path / "tp2"))["steps"][0]["resident_reused"] == 1  # rank 1 alone

    helper = load()  # sync numbers count from 1 again
    monkeypatch.setenv(helper.ENV, str(tmp_path / "bf16"))
    model = _Model(tensors, dtype=torch.bfloat16)
    _sync(helper, model, tensors, 1)
    held = _resident(tmp_path / "bf16", 1)
    assert not any("same_as" in x or "hash" in x for x in held.values()), held
    assert held[NAMES[3]]["fp"] == helper.fingerprint(tensors[NAMES[3]].bfloat16())
    assert compare_run(read_run(tmp_path / "bf16"))["verdict"] == "EQUAL"


def test_without_received_checksums_nothing_is_reused(tmp_path, monkeypatch):
    """RL_MSPROBE_WEIGHTS_HASH=0: the received side has no checksum to match, so the resident
    side measures every part (as before reuse existed)."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    monkeypatch.setenv(helper.HASH_ENV, "0")
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1)
    held = _resident(tmp_path, 1)
    assert set(held) == set(NAMES) and not any("same_as" in x or "hash" in x for x in held.values())
    doc = compare_run(read_run(tmp_path))
    assert doc["verdict"] == "EQUAL" and doc["steps"][0]["resident_reused"] == 0

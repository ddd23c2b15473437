"""Issue 20's core rules on hand-made data: shard statistics merge exactly, replicated tensors must
agree across TP ranks, the fused training view, TP peers in correlate / check, and the
sensitivity rule (a 1% output change on an identical input diverges; bf16 round-off does not)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rl_msprobe.dumps import judge, tp_merge
from rl_msprobe.dumps.correlate import correlate
from rl_msprobe.dumps.fused import fuse
from rl_msprobe.dumps.layout import check_layout
from rl_msprobe.dumps.summary import summarize
from tests.dumps.conftest import dispatch, update, write_dump, write_jsonl
from tests.dumps.test_summary import _csv


def stats(a: np.ndarray) -> dict:
    """msprobe's statistics of a tensor (Max, Min, Mean, L2 Norm)."""
    return {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": list(a.shape),
        "Max": float(a.max()),
        "Min": float(a.min()),
        "Mean": float(a.mean()),
        "Norm": float(np.linalg.norm(a.ravel())),
        "requires_grad": False,
    }


@pytest.mark.parametrize("seed", range(6))
def test_merged_shard_statistics_are_the_whole_tensors(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 4))
    shape = [int(x) for x in rng.integers(2, 9, size=ndim)]
    dim = int(rng.integers(0, ndim))
    shape[dim] = int(rng.integers(3, 12))
    whole = rng.normal(loc=rng.normal(), scale=rng.uniform(0.1, 5), size=shape)
    cuts = sorted(set(int(c) for c in rng.integers(1, shape[dim], size=int(rng.integers(1, 3)))))
    shards = np.split(whole, cuts, axis=dim)  # unequal shards too (vocab padding)
    merged = tp_merge.merge_stats([stats(s) for s in shards], dim)
    want = stats(whole)
    assert merged["shape"] == want["shape"]
    assert merged["Max"] == want["Max"] and merged["Min"] == want["Min"]  # exact
    assert merged["Mean"] == pytest.approx(want["Mean"], rel=1e-12, abs=1e-12)
    assert merged["Norm"] == pytest.approx(want["Norm"], rel=1e-12)


def _entry(inputs: list[np.ndarray], outputs: list[np.ndarray], **params: np.ndarray) -> dict:
    doc = {
        "input_args": [stats(x) for x in inputs],
        "input_kwargs": {},
        "output": [stats(y) for y in outputs],
    }
    if params:
        doc["parameters"] = {k: stats(v) for k, v in params.items()}
    return doc


def _tp_dumps(perturb_rank1_norm: float = 1.0) -> tuple[list[dict], dict, dict]:
    """Two TP ranks of a column-parallel qkv, a row-parallel o_proj, a norm, an embedding."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8))
    w_qkv, w_o, w_emb = rng.normal(size=(12, 8)), rng.normal(size=(8, 6)), rng.normal(size=(10, 8))
    qkv = x @ w_qkv.T
    attn = qkv[:, :6]
    o = attn @ w_o.T
    norm_w = rng.normal(size=8)
    normed = o * norm_w
    ids = np.arange(5.0)
    ranks = []
    for r in range(2):
        col = slice(6 * r, 6 * r + 6)
        half = slice(3 * r, 3 * r + 3)
        ranks.append(
            {
                "Module.model.embed_tokens.VocabParallelEmbedding.forward.0": _entry(
                    [ids], [x], weight=w_emb[5 * r : 5 * r + 5]
                ),
                "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0": _entry(
                    [x], [qkv[:, col]], weight=w_qkv[col]
                ),
                "Module.model.layers.0.self_attn.rotary_emb.RotaryEmbedding.forward.0": _entry(
                    [ids, qkv[:, col]], [qkv[:, col] * 2]
                ),
                "Module.model.layers.0.self_attn.o_proj.RowParallelLinear.forward.0": _entry(
                    [attn[:, half]], [o], weight=w_o[:, half]
                ),
                "Module.model.layers.0.post_attention_layernorm.RMSNorm.forward.0": _entry(
                    [o], [normed * (perturb_rank1_norm if r == 1 else 1.0)], weight=norm_w
                ),
            }
        )
    whole = {
        "qkv_out": stats(qkv),
        "qkv_w": stats(w_qkv),
        "o_in": stats(attn),
        "o_w": stats(w_o),
        "emb_w": stats(w_emb),
    }
    train = {
        "Module.model.layers.0.post_attention_layernorm.Qwen2RMSNorm.forward.0": _entry([o], [normed]),
        "Module.model.layers.0.self_attn.o_proj.Linear.forward.0": _entry([attn[None]], [o[None]]),
    }
    return ranks, whole, train


def test_tp_ranks_merge_by_class_and_shape_and_replicas_agree() -> None:
    ranks, whole, train = _tp_dumps()
    merged = tp_merge.merge(ranks, train)
    data = merged.data
    qkv = data["Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0"]
    o = data["Module.model.layers.0.self_attn.o_proj.RowParallelLinear.forward.0"]
    emb = data["Module.model.embed_tokens.VocabParallelEmbedding.forward.0"]
    for got, want in (
        (qkv["output"][0], whole["qkv_out"]),  # column-parallel output: last dim
        (qkv["parameters"]["weight"], whole["qkv_w"]),  # column-parallel weight: dim 0
        (o["input_args"][0], whole["o_in"]),  # row-parallel input: last dim
        (o["parameters"]["weight"], whole["o_w"]),  # row-parallel weight: dim 1
        (emb["parameters"]["weight"], whole["emb_w"]),  # vocab-parallel weight: dim 0
    ):
        assert got["shape"] == want["shape"] and got["Max"] == want["Max"] and got["Min"] == want["Min"]
        assert got["Norm"] == pytest.approx(want["Norm"]) and got["Mean"] == pytest.approx(want["Mean"])
    assert merged.sharded == {"QKVParallelLinear": 2, "RowParallelLinear": 2, "VocabParallelEmbedding": 1}
    # the rotary embedding sees each rank's own heads: it differs by design, it is not a finding
    assert not merged.disagreements and merged.unknown == 1


def test_a_replicated_tensor_that_differs_on_one_rank_is_a_finding() -> None:
    ranks, _, train = _tp_dumps(perturb_rank1_norm=1.01)
    merged = tp_merge.merge(ranks, train)
    assert [(d.key.split(".")[-4], d.tensor, d.ranks) for d in merged.disagreements] == [
        ("post_attention_layernorm", "output.0", [1])
    ]
    assert merged.disagreements[0].error > 0.005


def test_fused_training_view_from_shapes_and_inputs() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 5, 8))
    q, k, v, g = (rng.normal(size=(n, 8)) for n in (8, 4, 4, 16))
    train = {
        "Module.model.layers.0.self_attn.q_proj.Linear.forward.0": _entry([x], [x @ q.T], weight=q),
        "Module.model.layers.0.self_attn.k_proj.Linear.forward.0": _entry([x], [x @ k.T], weight=k),
        "Module.model.layers.0.self_attn.v_proj.Linear.forward.0": _entry([x], [x @ v.T], weight=v),
        "Module.model.layers.0.self_attn.rotary.Rot.forward.0": _entry([x @ q.T], [x @ q.T]),
        "Module.model.layers.0.mlp.gate_proj.Linear.forward.0": _entry([x], [x @ g.T], weight=g),
    }
    qkv = np.concatenate([x @ q.T, x @ k.T, x @ v.T], axis=-1)[0]
    rollout = {"Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0": _entry([x[0]], [qkv])}
    fused, notes = fuse(train, rollout)
    assert list(fused) == [
        "Module.model.layers.0.self_attn.qkv_proj.Linear.forward.0",
        "Module.model.layers.0.self_attn.rotary.Rot.forward.0",
        "Module.model.layers.0.mlp.gate_proj.Linear.forward.0",
    ]
    out = fused["Module.model.layers.0.self_attn.qkv_proj.Linear.forward.0"]["output"][0]
    assert out["shape"] == [1, 5, 16] and out["Norm"] == pytest.approx(float(np.linalg.norm(qkv)))
    assert notes and "q_proj + k_proj + v_proj" in notes[0]
    # widths that do not add up: nothing is fused
    rollout_bad = {
        "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0": _entry([x[0]], [qkv[:, :15]])
    }
    assert fuse(train, rollout_bad) == (train, [])


STATS = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "Bench max", "Bench min", "Bench l2norm"]
STATS += ["Max diff", "Min diff", "Mean diff", "L2norm diff", "NormRelativeErr", "Result", "Err_message"]
N = "Module.model.layers.{l}.{m}.forward.0.{x}"


def _stat_row(
    layer: int, module: str, x: str, rel: float, dtype: str = "torch.float32", result: str = "pass"
):
    """A statistics row whose tensor differs by `rel` (relative) between the sides."""
    name = N.format(l=layer, m=module, x=x)
    return [name, name, dtype, dtype, "2.0", "-2.0", "10.0", f"{2 * rel}", f"{-2 * rel}", "0", f"{10 * rel}"]


def _csv_rows(rows: list[list], tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    return _csv(tmp, [[*r, f"{100 * float(r[10]) / 10}%", "pass", "[]"] for r in rows], STATS)


def _chain(planted: int | None, rel: float, dtype: str = "torch.float32", noise: float = 2e-7) -> list[list]:
    """Three layers of (norm, down_proj); each module passes its input's error on; the planted
    module (index in forward order) multiplies its output by 1+rel on the rollout side."""
    rows, err, i = [], noise, 0
    for layer in range(3):
        for module in ("input_layernorm.RMSNorm", "mlp.down_proj.RowParallelLinear"):
            rows.append(_stat_row(layer, module, "input.0", err, dtype))
            err = max(err, noise) + (rel if i == planted else 0.0)
            rows.append(_stat_row(layer, module, "output.0", err, dtype))
            i += 1
    return rows


def test_a_one_percent_output_change_on_an_identical_input_diverges_there(tmp_path: Path) -> None:
    for planted in range(6):
        s = summarize(_csv_rows(_chain(planted, 0.01), tmp_path / str(planted)))
        first = s.first_divergence
        expect = "model.layers.{}.{}".format(planted // 2, ("input_layernorm", "mlp.down_proj")[planted % 2])
        assert first is not None and first.module == expect and first.tensor == "output.0", (planted, first)
        # later modules only carry it: one finding
        assert len(s.divergent) == 1
        j = s.first_judgement
        assert j.floor_ratio > 10 and j.gain > 10 and j.precision == "fp32"


def test_bf16_round_off_is_not_a_divergence(tmp_path: Path) -> None:
    """0.435% NormRelativeErr on a down_proj (DOMAIN §9, identical weights, both sides bf16)."""
    rows = _chain(planted=3, rel=0.00435, dtype="torch.bfloat16", noise=0.002)
    s = summarize(_csv_rows(rows, tmp_path))
    assert s.consistent and {j.precision for j in s.judgements} == {"bf16"}
    assert s.floors() == {"bf16": judge.NOISE_FLOOR["bf16"]}
    # the same change in fp32 is one
    assert not summarize(_csv_rows(_chain(3, 0.00435), tmp_path / "fp32")).consistent


def _peer_tree(tmp_path: Path, ranks=(0, 1), tp_size: int | None = 2, drop_dump: int | None = None):
    gen, actor = tmp_path / "gen", tmp_path / "actor"
    for rank in ranks:
        pid = 100 + rank
        lines = []
        for step, rid in enumerate(("aaaa-0badc0de", "bbbb-0badc0de")):
            line = dispatch(pid, rank, step, "prefill", (rid, "new", 7))
            if tp_size:
                line.update(tp_rank=rank, tp_size=tp_size)
            lines.append(line)
            if not (drop_dump == rank and step == 1):
                write_dump(gen / str(pid) / f"step{step}" / f"rank{rank}")
        write_jsonl(gen / str(pid) / "dispatch_log.jsonl", lines)
    for rank, rid in enumerate(("aaaa", "bbbb")):
        write_jsonl(actor / str(300 + rank) / "update_actor_log.jsonl", [update(300 + rank, rank, 0, rid)])
        write_dump(actor / "step0" / f"rank{rank}")
    return gen, actor


def test_correlate_names_tp_peers_and_a_pair_carries_every_rank(tmp_path: Path) -> None:
    gen, actor = _peer_tree(tmp_path)
    c = correlate(gen, actor)
    assert [len(p.rollout_ranks) for p in c.pairs] == [2, 2] and not c.unmatched
    assert {(s.pid, s.rank) for s in c.pairs[0].rollout_ranks} == {(100, 0), (101, 1)}
    assert c.used_lines() == {
        "rollout: one-request prefill": 2,
        "rollout: one-request prefill (TP peer rank)": 2,
        "train: matched": 2,
    }
    assert "rollout: repeated prefill of a request" not in c.skipped


def test_a_missing_tp_rank_is_named_by_correlate_and_check(tmp_path: Path) -> None:
    gen, actor = _peer_tree(tmp_path, ranks=(0,))
    c = correlate(gen, actor)
    assert not c.pairs and all("missing TP rank" in u.why for u in c.unmatched if u.side == "rollout")
    report = check_layout([gen, actor], "consistency")
    assert any("missing tensor-parallel rank(s) 1 of 2" in p["what"] for p in report.problems), (
        report.problems
    )


def test_tp_ranks_with_different_step_counts_fail_check(tmp_path: Path) -> None:
    gen, actor = _peer_tree(tmp_path, drop_dump=1)
    report = check_layout([gen, actor], "consistency")
    assert any(
        "different numbers of steps" in p["what"] and "rank 1 pid 101: 1" in p["what"]
        for p in report.problems
    ), report.problems
    assert json.dumps(report.to_json())


def test_fused_shards_are_put_back_in_the_order_of_their_parts(tmp_path: Path) -> None:
    """tensor_files.concat: each rank holds a slice of every part ([q_r k_r v_r]); the whole is
    [q k v]. Parts that do not split over the ranks are refused, naming the file."""
    import torch

    from rl_msprobe.dumps import tensor_files

    q, k, v = torch.randn(3, 8), torch.randn(3, 4), torch.randn(3, 4)
    files = []
    for r in range(2):
        shard = torch.cat([q[:, 4 * r : 4 * r + 4], k[:, 2 * r : 2 * r + 2], v[:, 2 * r : 2 * r + 2]], -1)
        files.append(str(tmp_path / f"rank{r}.pt"))
        torch.save(shard, files[-1])
    job = {"files": files, "dim": 1, "parts": [8, 4, 4], "out": str(tmp_path / "whole.pt")}
    reply = tensor_files.handle({"op": "concat", "jobs": [job]})
    assert reply["ok"], reply
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert torch.equal(whole, torch.cat([q, k, v], -1))
    assert reply["results"][0]["Norm"] == pytest.approx(float(torch.linalg.vector_norm(whole.double())))
    plain = tensor_files.handle({"op": "concat", "jobs": [{**job, "parts": None}]})
    assert plain["ok"] and not torch.equal(torch.load(tmp_path / "whole.pt", weights_only=True), whole)
    bad = tensor_files.handle({"op": "concat", "jobs": [{**job, "parts": [7, 5, 4]}]})
    assert not bad["ok"] and "rank0.pt" in bad["error"] and "do not split evenly" in bad["error"]


def test_tensor_mode_shards_of_several_tp_ranks_are_concatenated(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    """Real msprobe tensor dumps of a TP=2 gloo group (position_standin.py): the prefill's shards,
    concatenated (fused qkv / gate_up parts put back in the training order), are the TP=1 rollout's
    tensors, and msprobe's own compare of the merged step against the training forward passes."""
    import torch

    from rl_msprobe.dumps import inputs
    from rl_msprobe.dumps.compare import run_one
    from rl_msprobe.dumps.correlate import Pair, Side
    from rl_msprobe.dumps.runners import ProcessRunner, interpreter
    from tests.dumps.conftest import step_dumps

    ranks = step_dumps(position_dumps["tp"])[0]
    whole = step_dumps(position_dumps["clean"])[0][0]
    train = step_dumps(position_dumps["train_prompt"])[0][0]
    given = inputs.prepare(train, ranks[0], tmp_path / "given", "fsdp", (ranks[1],))
    assert given.rollout != ranks[0] and given.written
    merged = given.rollout.parent / inputs.TENSOR_DIR

    def load(folder: Path, name: str) -> torch.Tensor:
        return torch.load(folder / name, weights_only=True)

    names = {
        "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0.output.0.pt": 1e-5,
        "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0.parameters.weight.pt": 0.0,
        "Module.model.layers.1.mlp.gate_up_proj.MergedColumnParallelLinear.forward.0.output.0.pt": 1e-5,
        "Module.model.layers.1.mlp.down_proj.RowParallelLinear.forward.0.input.0.pt": 1e-5,
        "Module.model.embed_tokens.VocabParallelEmbedding.forward.0.parameters.weight.pt": 0.0,
        "Module.lm_head.ParallelLMHead.forward.0.output.0.pt": 1e-5,  # by shape: [T, V/2] of [1, T, V]
    }
    for name, atol in names.items():
        assert name in given.written, sorted(given.written)
        got, want = load(merged, name), load(whole.parent / inputs.TENSOR_DIR, name)
        assert got.shape == want.shape and torch.allclose(got, want, atol=atol, rtol=0), name
        # the shards as they are ([q0 k0 v0 q1 k1 v1]) would not be: the order is what is tested
        shards = [load(r.parent / inputs.TENSOR_DIR, name) for r in ranks]
        dim = 0 if "weight" in name else -1
        if "qkv" in name or "gate_up" in name:
            assert not torch.allclose(torch.cat(shards, dim), want, atol=1e-3)
    doc = json.loads(given.rollout.read_text())["data"]
    qkv = doc["Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0"]["output"][0]
    assert qkv["shape"] == [8, 256] and qkv["data_name"].endswith("output.0.pt")
    # the replicated tensors are rank 0's own files, linked
    norm = "Module.model.layers.0.input_layernorm.RMSNorm.forward.0.output.0.pt"
    assert norm not in given.written and (merged / norm).is_file()
    # msprobe's own compare of the merged step
    side = lambda p: Side(None, None, None, str(p))  # noqa: E731
    pair = Pair("tp2", side(ranks[0]), side(train), (side(ranks[1]),))
    result = run_one(1, pair, tmp_path / "out", "fsdp", ProcessRunner(interpreter(None)))
    assert result.error is None, result.error
    assert result.status == "consistent", result.summary.to_json() if result.summary else None


def test_a_shard_the_class_does_not_name_is_found_by_shape() -> None:
    """Qwen3's q_norm / k_norm (RMSNorm) see a rank's heads: [T, H/tp, D] against the training
    [1, T, H, D] is a shard on the heads; a whole tensor, or other ratios, are not."""
    assert tp_merge.shard_dim_by_shape([5, 2, 32], [1, 5, 4, 32], 2) == 1
    assert tp_merge.shard_dim_by_shape([5, 1, 32], [1, 5, 2, 32], 2) == 1  # one head per rank
    assert tp_merge.shard_dim_by_shape([5, 4, 32], [1, 5, 4, 32], 2) is None  # whole: replicated
    assert tp_merge.shard_dim_by_shape([5, 2, 32], [1, 5, 6, 32], 2) is None
    assert tp_merge.shard_dim_by_shape([5, 2, 32], None, 2) is None
    rng = np.random.default_rng(3)
    q = rng.normal(size=(5, 4, 32))
    ranks = [
        {
            "Module.model.layers.0.self_attn.q_norm.RMSNorm.forward.0": _entry(
                [q[:, 2 * r : 2 * r + 2]], [q[:, 2 * r : 2 * r + 2]]
            )
        }
        for r in range(2)
    ]
    train = {"Module.model.layers.0.self_attn.q_norm.Qwen3RMSNorm.forward.0": _entry([q[None]], [q[None]])}
    merged = tp_merge.merge(ranks, train)
    out = merged.data["Module.model.layers.0.self_attn.q_norm.RMSNorm.forward.0"]["output"][0]
    assert out["shape"] == [5, 4, 32] and out["Norm"] == pytest.approx(float(np.linalg.norm(q)))
    assert merged.sharded == {"RMSNorm (by shape)": 2} and not merged.disagreements

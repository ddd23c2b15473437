"""Records against records (rl_msprobe/dumps/record_compare.py), made by the shared writer on a tiny
torch model (tests/dumps/record_models.py): the batch split differently on each side, TP = 2, planted
1% faults at one module and position, other token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from rl_msprobe.dumps import judge, record_compare, records  # noqa: E402
from rl_msprobe.dumps.summary import own_row  # noqa: E402
from tests.dumps import record_models as rm  # noqa: E402

LENGTHS = {"A": (6, 4), "B": (4, 6), "C": (2, 3)}  # prompt, response


def run(tmp_path: Path, tp: int = 1, plants=(), rollout=None, train=None, **kw):
    tokens = rm.tokens_of(LENGTHS)
    root = rm.write_job(
        tmp_path / "rec",
        tokens,
        {},
        rollout if rollout is not None else rm.batched_schedule(LENGTHS, chunk=2),
        train if train is not None else [["A", "B", "C"]],
        tp=tp,
        plants=tuple(plants),
        **kw,
    )
    found = records.find([root])
    assert found is not None
    job = record_compare.compare_job(found)
    return job, {r.request_id: r for r in job.results}


@pytest.mark.parametrize("tp", [1, 2])
def test_clean_is_consistent_at_every_position_however_the_batch_is_split(tmp_path: Path, tp: int) -> None:
    job, by = run(tmp_path, tp)
    assert set(by) == {"A", "B", "C"}
    for rid, r in by.items():
        assert r.status == "consistent", r.verdict()
        p, n = LENGTHS[rid]
        assert r.result is not None and r.result.prompt == p and r.result.train_tokens == p + n
        assert [s[0] for s in r.result.spans()] == list(range(p + n - 1))  # every row, the prompt row by row
        assert r.result.uncovered == [p + n - 1]
        assert "SiluAndMul" in " ".join(r.result.not_judged)
    assert job.sizes["rollout"] > 0 and job.sizes["train"] > 0 and not job.only["rollout"]
    # one forward per position on the rollout, one forward per request on the training side
    _, other = run(tmp_path / "b", tp, rollout=rm.per_position_schedule(LENGTHS), train=[["A"], ["B"], ["C"]])
    assert all(r.status == "consistent" for r in other.values()), [r.verdict() for r in other.values()]


@pytest.mark.parametrize(
    ("plant", "phase"),
    [
        (rm.Plant("rollout", "model.layers.1.mlp.down_proj", "B", 2), "prefill"),
        (rm.Plant("rollout", "model.layers.0.self_attn.o_proj", "A", 7), "decode"),
        (rm.Plant("train", "model.layers.1.self_attn.q_proj", "C", 3), "decode"),
    ],
)
def test_a_planted_fault_is_named_at_its_module_and_position(
    tmp_path: Path, plant: rm.Plant, phase: str
) -> None:
    _, by = run(tmp_path, 1, [plant])
    r = by[plant.request]
    assert r.status == "divergent" and r.result is not None, r.verdict()
    where, j = r.result.first  # type: ignore[misc]
    module = plant.module.replace("q_proj", "qkv_proj")  # the rollout's fused module carries the name
    assert (where.start, where.phase, j.module) == (plant.position, phase, module), r.verdict()
    assert j.error == pytest.approx(0.01, rel=0.3) or plant.side == "train"
    assert all(o.status == "consistent" for k, o in by.items() if k != plant.request)


def test_a_fault_on_one_tp_rank_is_named_with_the_rank(tmp_path: Path) -> None:
    # a replicated output (row-parallel, after the all-reduce) wrong on rank 1 only
    _, by = run(tmp_path, 2, [rm.Plant("rollout", "model.layers.0.mlp.down_proj", "A", 3, tp_rank=1)])
    r = by["A"]
    assert r.status == "divergent" and r.result is not None
    where, j = r.result.first  # type: ignore[misc]
    assert (where.start, j.module) == (3, "model.layers.0.mlp.down_proj") and "TP rank 1" in j.tensor
    assert "TP rank 1" in r.verdict()
    # a shard wrong on rank 1: the merged column-parallel output diverges there
    _, by = run(
        tmp_path / "shard", 2, [rm.Plant("rollout", "model.layers.1.self_attn.qkv_proj", "B", 6, tp_rank=1)]
    )
    where, j = by["B"].result.first  # type: ignore[union-attr,misc]
    assert (where.start, where.phase, j.module) == (6, "decode", "model.layers.1.self_attn.qkv_proj")


def test_other_token_ids_are_not_compared_naming_the_position(tmp_path: Path) -> None:
    tokens = rm.tokens_of(LENGTHS)
    changed = {k: list(v) for k, v in tokens.items()}
    changed["B"][5] = (changed["B"][5] + 1) % rm.VOCAB
    _, by = run(tmp_path, 1, train_tokens=changed)
    assert by["B"].status == "not compared"
    assert "token ids differ at position 5" in by["B"].verdict()
    assert by["A"].status == "consistent"


def test_a_missing_rank_or_position_is_not_compared(tmp_path: Path) -> None:
    tokens = rm.tokens_of(LENGTHS)
    root = rm.write_job(tmp_path / "rec", tokens, {}, rm.batched_schedule(LENGTHS), [["A", "B", "C"]], tp=2)
    (root / "rollout" / "1001" / "rec3.json").unlink()  # rank 1's fourth forward never finished
    job = record_compare.compare_job(records.find([root]) or {})
    assert job.unfinished["rollout"] == 1 and "unfinished" in " ".join(job.notes())
    bad = [r for r in job.results if r.status != "consistent"]
    assert bad and all("TP rank 1 has no record of position" in r.verdict() for r in bad)


def test_judge_arrays_is_judge_position_by_position() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    n = 40
    names = ["m0", "m1", "m2", "m3"]
    errors = {
        (m, t): np.where(rng.random(n) < 0.2, np.nan, rng.random(n) * 1e-3)
        for m in names
        for t in ("input.0", "output.0", "output.1")
    }
    spec = [
        (
            m,
            [errors[(m, "input.0")]] if m != "m2" else [],
            [(errors[(m, "output.0")], 1e-4), (errors[(m, "output.1")], 1e-4)],
        )
        for m in names
    ]
    fast = judge.judge_arrays(spec, n)
    for p in range(n):
        rows = []
        for m in names:
            for t in (("input.0",) if m != "m2" else ()) + ("output.0", "output.1"):
                e = errors[(m, t)][p]
                rows.append(
                    own_row(
                        len(rows),
                        f"Module.{m}.X.forward.0.{t}",
                        "t",
                        None if np.isnan(e) else float(e),
                        dtypes=("torch.float32", "torch.float32"),
                    )
                )
        slow = {j.module: j for j in judge.judge(rows)}
        for m, jm in zip(names, fast):
            assert jm is not None
            assert bool(jm.measured[p]) == (m in slow)
            if m in slow:
                assert (float(jm.error[p]), bool(jm.divergent[p])) == (slow[m].error, slow[m].divergent)
                assert float(jm.received[p]) == pytest.approx(slow[m].received)


@pytest.mark.parametrize("tp, train_tp", [(1, 2), (2, 2), (2, 4)])
def test_training_tp_ranks_merge_clean_and_a_one_rank_fault_is_named(
    tmp_path: Path, tp: int, train_tp: int
) -> None:
    """Megatron's TP ranks on the training side (column shards of q / k / v / gate / up, row-parallel
    o / down inputs, replicated norms and residuals) merge like the rollout's, whatever the rollout's
    TP: clean is CONSISTENT at every position with what TP = 1 judges; a fault in a replicated tensor
    on one training rank is DIVERGENT naming the training's rank; in a shard, at its module."""
    _, single = run(tmp_path / "one", tp)
    _, by = run(tmp_path / "clean", tp, train_tp=train_tp)
    for rid, r in by.items():
        assert r.status == "consistent", r.verdict()
        assert r.result is not None and single[rid].result is not None
        assert r.result.not_judged == single[rid].result.not_judged, r.result.not_judged
    _, by = run(
        tmp_path / "norm",
        tp,
        [rm.Plant("train", "model.layers.1.post_attention_layernorm", "B", 5, tp_rank=1)],
        train_tp=train_tp,
    )
    r = by["B"]
    assert r.status == "divergent" and r.result is not None, r.verdict()
    where, _ = r.result.first  # type: ignore[misc]
    assert where.start == 5, r.verdict()
    assert any("on the training's TP rank 1" in text for text, _ in r.result.tp.values()), r.result.tp
    _, by = run(
        tmp_path / "shard",
        tp,
        [rm.Plant("train", "model.layers.0.mlp.up_proj", "A", 3, tp_rank=0)],
        train_tp=train_tp,
    )
    r = by["A"]
    assert r.status == "divergent" and r.result is not None, r.verdict()
    where, j = r.result.first  # type: ignore[misc]
    assert where.start == 3 and "layers.0.mlp" in j.module, r.verdict()
    assert all(o.status == "consistent" for k, o in by.items() if k != "A")


def test_a_training_tp_rank_without_records_is_not_compared(tmp_path: Path) -> None:
    import shutil

    root = rm.write_job(
        tmp_path / "rec",
        rm.tokens_of(LENGTHS),
        {},
        rm.batched_schedule(LENGTHS, chunk=2),
        [["A", "B", "C"]],
        train_tp=2,
    )
    shutil.rmtree(root / "train" / "2001")
    found = records.find([root])
    assert found is not None
    job = record_compare.compare_job(found)
    assert all(r.status == "not compared" for r in job.results), [r.verdict() for r in job.results]
    assert "the training's TP rank(s) [1] of 2 wrote no record" in job.results[0].verdict()

"""Lazy statistics, the default (RL_MSPROBE_WEIGHTS_STATS unset): the sender takes only the k64
checksum (`"fp": null`), and the statistics are taken at the first later stage whose checksum
cannot stand for them. A sync whose bytes arrive and load unchanged costs two checksums and no
statistics; every fault is still named at its stage, by how much wherever both sides could be
measured (a loader fault), by its bits where the sender's statistics were never taken (a
transfer fault)."""

from __future__ import annotations

import json

import pytest

from rl_msprobe.errors import UserError
from rl_msprobe.weights.checkpoint import compare_checkpoint
from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.fingerprint import Fingerprint
from rl_msprobe.weights.records import Entry, read_run
from rl_msprobe.weights.report import summary_lines
from tests.weights.helper import load
from tests.weights.test_received_reuse import _received, _sent, _sync
from tests.weights.test_resident_reuse import NAMES, _Model, _tensors

QKV, LATER = NAMES[:3], NAMES[3:]  # checked in the bucket (before the repack); after it (`settled`)


def _resident(folder, sync: int) -> dict[str, dict]:
    lines = [json.loads(x) for p in folder.glob("resident-*.jsonl") for x in p.read_text().splitlines()]
    return {x["name"]: x for x in lines if x["sync"] == sync and x["stage"] == "resident"}


def _differs(doc) -> dict[tuple[int, str, str], str]:
    return {
        (r["sync"], r["name"], stage): r[stage].get("what")
        for r in doc["tensors"]
        for stage in ("received", "resident")
        if r[stage]["status"] == "differs"
    }


def test_a_clean_sync_takes_no_statistics_after_the_first_and_compares_equal(tmp_path, monkeypatch):
    """Sent: checksums only. Sync 1: every resident part measured (the engine's load, what
    `weights compare --checkpoint` reads). Sync 2: the fused parts checked in the bucket have no
    statistics at any stage; the norm and the embedding, checked only after the bucket, are
    measured once as received and reused as resident. Both syncs EQUAL."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    monkeypatch.delenv(helper.STATS_ENV, raising=False)
    tensors = _tensors()
    model = _Model(tensors)
    for sync in (1, 2):
        _sync(helper, model, tensors, sync, settles=True)
    for sync in (1, 2):
        sent = _sent(tmp_path, sync)
        assert all(sent[n]["fp"] is None and sent[n]["hash"] == helper.digest(tensors[n]) for n in NAMES)
    first, second = _resident(tmp_path, 1), _resident(tmp_path, 2)
    assert all(first[n]["fp"] == helper.fingerprint(tensors[n]) for n in NAMES)
    assert not any(first[n].get("same_as") for n in QKV)  # measured, though the checksums agreed
    got = _received(tmp_path, 2)
    assert {n: got[n]["fp"] is None for n in NAMES} == {
        **dict.fromkeys(QKV, True),
        **dict.fromkeys(LATER, False),
    }
    assert all(got[n]["fp"] == helper.fingerprint(tensors[n]) for n in LATER)
    assert {n: second[n]["fp"] is None for n in NAMES} == {n: got[n]["fp"] is None for n in NAMES}
    assert {second[n]["same_as"] for n in NAMES} == {"received"}
    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "EQUAL"], doc["steps"]
    assert doc["steps"][1]["received_implied"] == len(QKV)


def test_every_fault_is_named_at_its_stage(tmp_path, monkeypatch):
    """Sync 2: k_proj scaled on the wire; sync 3: the loader scales q_proj; sync 4: the wire scales
    the norm (checked after the bucket); sync 5: v_proj permuted on the wire (statistics equal).
    A transfer fault is named at stage received by its bits (the sender took no statistics), its
    received tensor measured and the resident reusing it; a loader fault at stage resident by how
    much (both sides measured once the checksums disagreed)."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    model = _Model(tensors)
    _sync(helper, model, tensors, 1, settles=True)
    _sync(helper, model, tensors, 2, wire={NAMES[1]: lambda t: t * 1.001}, settles=True)
    model.faults = {NAMES[0]: lambda t: t * 1.001}
    _sync(helper, model, tensors, 3, settles=True)
    model.faults = {}
    _sync(helper, model, tensors, 4, wire={NAMES[3]: lambda t: t * 1.001}, settles=True)
    _sync(helper, model, tensors, 5, wire={NAMES[2]: lambda t: t.flip(0)}, settles=True)

    assert _received(tmp_path, 2)[NAMES[1]]["fp"] == helper.fingerprint(tensors[NAMES[1]] * 1.001)
    third = _received(tmp_path, 3)
    assert third[NAMES[0]]["fp"] == helper.fingerprint(tensors[NAMES[0]])  # measured: the resident disagreed
    assert _resident(tmp_path, 3)[NAMES[0]]["fp"] == helper.fingerprint(tensors[NAMES[0]] * 1.001)
    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL"] + ["DIFFERENT"] * 4, doc["steps"]
    lazy = "bits (hash differs; statistics not taken on one side: lazy)"
    differs = _differs(doc)
    assert differs.pop((3, NAMES[0], "resident")) in ("sum", "sum of squares", "min", "max")
    assert differs == {
        (2, NAMES[1], "received"): lazy,
        (4, NAMES[3], "received"): lazy,
        (5, NAMES[2], "received"): lazy,
    }
    loader = next(r for r in doc["tensors"] if r["sync"] == 3 and r["name"] == NAMES[0])["resident"]
    assert loader["ratio"] > 1 and loader["norm_rel"] == pytest.approx(0.001, rel=1e-3)
    lines = {x.split(":")[0]: x for x in summary_lines(doc) if " differs: " in x}
    assert "None" not in "".join(lines.values()), lines  # what was not measured is left out, not printed
    assert lines["  sync 3 resident differs"].endswith(
        f"(norm rel 0.001, {loader['what']}, {loader['ratio']:.3g}x tolerance)"
    )
    assert lines["  sync 2 received differs"].endswith(
        f"({lazy})"
    )  # no norm and no tolerance ratio: never measured


def test_a_tp_rank_measures_what_it_received(tmp_path, monkeypatch):
    """TP 2: a rank's resident shard is no received tensor, so each received tensor is measured
    whole and by its chunks (what its shard must match); the sent checksum still decides the
    transfer. Both ranks' processes: EQUAL; a loader fault in rank 1's shard names rank 1."""
    tensors = _tensors()
    for rank in (0, 1):
        helper = load()
        monkeypatch.setenv(helper.ENV, str(tmp_path / f"rank{rank}"))
        model = _Model(tensors, tp=2, rank=rank)
        _sync(helper, model, tensors, 1, settles=True)
        model.faults = {NAMES[0]: lambda t: t * 1.001} if rank == 1 else {}
        _sync(helper, model, tensors, 2, settles=True)
        for path in (tmp_path / f"rank{rank}").glob("*.jsonl"):  # one process per rank, as in a job
            stage = path.name.split("-")[0]
            if rank == 0 or stage != "sent":
                path.rename(tmp_path / f"{stage}-host-{rank}.jsonl")
    got = _received(tmp_path, 1)
    for name in NAMES:  # measured here (the whole and this rank's rows in one pass: sums in pieces)
        assert got[name]["fp"]["sumsq"] == pytest.approx(
            helper.fingerprint(tensors[name])["sumsq"], rel=1e-12
        )
        assert "same_as" not in got[name] and "shard_fp" in got[name] or tensors[name].dim() == 1
    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT"], doc["steps"]
    assert set(_differs(doc)) == {(2, NAMES[0], "resident")}
    row = next(r for r in doc["tensors"] if r["sync"] == 2 and r["name"] == NAMES[0])
    assert row["resident"]["faulty_ranks"] == [1]


def test_the_checkpoint_compares_at_the_first_sync_and_says_why_not_at_a_lazy_one(tmp_path, monkeypatch):
    """The first sync's resident parts are measured, so the checkpoint compares there; at a later
    sync a part with only its checksum cannot be held against the checkpoint's statistics: NOT
    COMPARED with the reason, never EQUAL."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    model = _Model(tensors)
    for sync in (1, 2):
        _sync(helper, model, tensors, sync, settles=True)
    checkpoint = {
        name: Entry(
            "checkpoint",
            0,
            0,
            "model.safetensors",
            name,
            i,
            "float32",
            Fingerprint.from_dict(helper.fingerprint(t)),
            shape=tuple(t.shape),
        )  # fmt: skip
        for i, (name, t) in enumerate(tensors.items())
    }
    run = read_run(tmp_path)
    assert compare_checkpoint(run, checkpoint)["verdict"] == "EQUAL"
    later = compare_checkpoint(run, checkpoint, sync=2)
    assert later["verdict"] == "NOT COMPARED"
    blind = {r["name"] for r in later["tensors"] if r["status"] == "not-compared"}
    assert blind == set(QKV) and all(
        "lazy statistics" in r["why"] for r in later["tensors"] if r["name"] in blind
    )


@pytest.mark.parametrize("env", [{"RL_MSPROBE_WEIGHTS_STATS": "all"}, {"RL_MSPROBE_WEIGHTS_HASH": "0"}])
def test_statistics_at_send_when_asked_or_without_checksums(env, tmp_path, monkeypatch):
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1, settles=True)
    assert all(x["fp"] == helper.fingerprint(tensors[n]) for n, x in _sent(tmp_path, 1).items())
    assert compare_run(read_run(tmp_path))["verdict"] == "EQUAL"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hash": None}, "fp is null without a hash"),
        ({"shape": None}, "nothing to count the elements by"),
        ({"shape": [2, -1]}, "not a list of sizes"),
    ],
)
def test_a_line_without_statistics_needs_its_checksum_and_shape(change, message, tmp_path, monkeypatch):
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1, settles=True)
    path = next(tmp_path.glob("sent-*.jsonl"))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[1].update(change)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(UserError, match=message) as caught:
        read_run(tmp_path)
    assert f"{path}:2" in str(caught.value)


def test_a_receiver_without_checksums_leaves_a_lazy_sender_not_compared(tmp_path, monkeypatch):
    """The sender lazy, the receiving process with RL_MSPROBE_WEIGHTS_HASH=0 (one process's
    environment differs): nothing decides whether the bytes arrived unchanged: NOT COMPARED, why."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    stream = list(helper.sent(iter(tensors.items()), 1))
    monkeypatch.setenv(helper.HASH_ENV, "0")
    _sync(helper, _Model(tensors), dict(stream), 2, tagged=False)
    for path in tmp_path.glob("*.jsonl"):  # the two halves of one sync, as two processes write them
        path.write_text(path.read_text().replace('"sync": 2', '"sync": 1'))
    for path in tmp_path.glob("sent-*.jsonl"):
        lines = [x for x in path.read_text().splitlines() if json.loads(x)["fp"] is None]
        path.write_text("".join(x + "\n" for x in lines))
    doc = compare_run(read_run(tmp_path))
    assert doc["verdict"] == "NOT COMPARED"
    assert {r["received"]["status"] for r in doc["tensors"]} == {"not-compared"}
    assert "RL_MSPROBE_WEIGHTS_STATS=all" in doc["tensors"][0]["received"]["why"]

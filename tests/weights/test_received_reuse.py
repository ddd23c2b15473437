"""The received stage reuses what was sent where the bytes are identical: the sender's {hash, fp}
of each tensor rides in its bucket metadata (`tag`, pickled with the bucket, `arrived`), and the
receiver takes only the k64 checksum of what it got; equal, the sender's statistics are written
(`"same_as": "sent"`); different (a transfer fault), or nothing carried, it measures them, so an
altered tensor is named at stage received by how much (or by its bits), never hidden."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.records import read_run
from tests.weights.helper import load
from tests.weights.test_resident_reuse import NAMES, _Model, _tensors


@pytest.fixture(autouse=True)
def _statistics_at_send(monkeypatch):
    """This module checks the reuse of the sender's statistics, which the sender takes with
    RL_MSPROBE_WEIGHTS_STATS=all; the default, lazy statistics, is tests/weights/test_lazy_statistics.py."""
    monkeypatch.setenv("RL_MSPROBE_WEIGHTS_STATS", "all")


def _sync(
    helper, model: _Model, tensors: dict[str, torch.Tensor], sync: int, wire=None, tagged=True, settles=None
) -> None:
    """One sync as the patched verl runs it: the actor's `sent` stream, the sender's metadata per
    tensor (tagged), the bucket pickled (verl's ZMQ send_pyobj) with its tensors through WIRE (a
    fault of the transfer: name -> function), the receiver's `arrived`, then the worker extension.
    SETTLES: as verl-weights-bucket patches the receiver, `arrived(..., settles=True)` and `settled()`
    once the bucket is loaded ("never": the promise without the call); None: the plain `arrived`."""

    class Worker:
        model_runner = type("Runner", (), {"model": model})()

        @helper.engine_sync
        def update_weights_from_ipc(self):
            metadata = pickle.loads(wire_bytes)
            helper.arrived(metadata, **({"settles": True} if settles else {}))
            named = [(n, (wire or {}).get(n, lambda t: t)(t.clone())) for n, t in bucket]
            helper.received(self, named)
            model.load_weights(named)
            if settles is True:
                helper.settled()

    bucket, meta = [], {}
    for name, tensor in helper.sent(iter(tensors.items()), sync):
        meta[name] = {"name": name, "shape": tensor.shape, "dtype": tensor.dtype}
        if tagged:
            helper.tag(meta[name], name)
        bucket.append((name, tensor))
    wire_bytes = pickle.dumps({"bucket_meta": meta, "is_last": True})
    helper._tp = lambda: (model.rank, model.tp)
    Worker().update_weights_from_ipc()


def _received(folder, sync: int) -> dict[str, dict]:
    lines = [json.loads(x) for p in folder.glob("received-*.jsonl") for x in p.read_text().splitlines()]
    return {x["name"]: x for x in lines if x["sync"] == sync}


def _sent(folder, sync: int) -> dict[str, dict]:
    lines = [json.loads(x) for p in folder.glob("sent-*.jsonl") for x in p.read_text().splitlines()]
    return {x["name"]: x for x in lines if x["sync"] == sync}


def test_identical_bytes_reuse_the_sent_statistics_and_an_altered_tensor_is_measured(tmp_path, monkeypatch):
    """Sync 1 clean: every received record is the sender's (same hash, same statistics, marked),
    EQUAL. Sync 2: k_proj scaled on the wire, its record measured (the altered tensor's own
    numbers, not the sender's), DIFFERENT naming it at stage received. Sync 3: v_proj permuted
    (statistics equal, bits not): measured, named by its hash."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    model = _Model(tensors)
    _sync(helper, model, tensors, 1)
    _sync(helper, model, tensors, 2, wire={NAMES[1]: lambda t: t * 1.001})
    _sync(helper, model, tensors, 3, wire={NAMES[2]: lambda t: t.flip(0)})

    sent, first = _sent(tmp_path, 1), _received(tmp_path, 1)
    assert {n: first[n].get("same_as") for n in NAMES} == dict.fromkeys(NAMES, "sent"), first
    for name, t in tensors.items():
        assert first[name]["hash"] == sent[name]["hash"] == helper.digest(t)
        assert first[name]["fp"] == sent[name]["fp"]
    second, third = _received(tmp_path, 2), _received(tmp_path, 3)
    assert [n for n in NAMES if "same_as" not in second[n]] == [NAMES[1]]
    altered = tensors[NAMES[1]] * 1.001
    assert second[NAMES[1]]["fp"] == helper.fingerprint(altered) != _sent(tmp_path, 2)[NAMES[1]]["fp"]
    assert second[NAMES[1]]["hash"] == helper.digest(altered)
    assert [n for n in NAMES if "same_as" not in third[n]] == [NAMES[2]]
    assert third[NAMES[2]]["hash"] == helper.digest(tensors[NAMES[2]].flip(0))

    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT", "DIFFERENT"], doc["steps"]
    assert [s["received_reused"] for s in doc["steps"]] == [5, 4, 4]
    assert [s["resident_reused"] for s in doc["steps"]] == [5, 5, 5]  # the loader wrote what came
    differs = {
        (r["sync"], r["name"], r["received"].get("what"))
        for r in doc["tensors"]
        if r["received"]["status"] == "differs"
    }
    assert {(s, n) for s, n, _ in differs} == {(2, NAMES[1]), (3, NAMES[2])}, differs
    assert (3, NAMES[2], "bits (hash differs, statistics equal in float64)") in differs
    assert doc["first_difference"]["stage"] == "received" and doc["first_difference"]["name"] == NAMES[1]


def test_nothing_carried_or_no_checksum_means_measured(tmp_path, monkeypatch):
    """A sender whose metadata carries nothing (its transfer not patched), and RL_MSPROBE_WEIGHTS_HASH=0
    (no checksum to match): every received tensor measured, as before; both still EQUAL."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path / "untagged"))
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1, tagged=False)
    got = _received(tmp_path / "untagged", 1)
    assert not any("same_as" in x for x in got.values()) and all(x["hash"] for x in got.values())
    assert got[NAMES[0]]["fp"] == helper.fingerprint(tensors[NAMES[0]])
    assert compare_run(read_run(tmp_path / "untagged"))["verdict"] == "EQUAL"

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path / "nohash"))
    monkeypatch.setenv(helper.HASH_ENV, "0")
    _sync(helper, _Model(tensors), tensors, 1)
    got = _received(tmp_path / "nohash", 1)
    assert not any("same_as" in x or x.get("hash") for x in got.values()), got
    doc = compare_run(read_run(tmp_path / "nohash"))
    assert doc["verdict"] == "EQUAL" and doc["steps"][0]["received_reused"] == 0


def test_a_tp_rank_reusing_the_sent_statistics_still_measures_its_own_chunks(tmp_path, monkeypatch):
    """TP 2, rank 1: the whole tensor's statistics come from the sender, this rank's chunks along
    dims 0 and 1 (what its resident shard must match) are measured, exactly those of the chunks;
    a tensor altered on the wire is measured whole, chunks included."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    _sync(helper, _Model(tensors, tp=2, rank=1), tensors, 1)
    got = _received(tmp_path, 1)
    assert {n: got[n].get("same_as") for n in NAMES} == dict.fromkeys(NAMES, "sent"), got
    q = tensors[NAMES[0]]
    assert got[NAMES[0]]["shard_fp"] == {
        "0": helper.fingerprint(q.chunk(2, 0)[1]),
        "1": helper.fingerprint(q.chunk(2, 1)[1]),
    }
    assert got[NAMES[0]]["hash"] == helper.digest(q)  # the checksum of the pass that measured the rows
    _sync(helper, _Model(tensors, tp=2, rank=1), tensors, 2, wire={NAMES[0]: lambda t: t * 1.001})
    altered = _received(tmp_path, 2)[NAMES[0]]
    assert "same_as" not in altered and altered["fp"] == helper.fingerprint(q * 1.001)
    assert altered["shard_fp"]["0"] == helper.fingerprint((q * 1.001).chunk(2, 0)[1])
    doc = compare_run(read_run(tmp_path))  # rank 1 alone: its resident shards are half of a model
    received = {(r["sync"], r["name"]): r["received"]["status"] for r in doc["tensors"]}
    assert {k for k, v in received.items() if v != "equal"} == {(2, NAMES[0])}, received
    assert [s["received_reused"] for s in doc["steps"]] == [len(NAMES), len(NAMES) - 1]

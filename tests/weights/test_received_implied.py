"""Received implied by resident (TP 1, a receiver patched to call `settled()` after each bucket):
the received checksum waits for the resident one of the same name, dtype and shape taken while
the bucket is loaded; equal to the sender's, the received record is the sender's (`"implied_by":
"resident"`), one read of the tensor instead of two. Any other resident checksum and the received
tensor is checksummed after all, so a transfer fault is still named at stage received and a
loader fault at stage resident; a part checked only after the bucket (`settled`) is checksummed
there; a receiver that promised `settled()` and never called it leaves those records missing."""

from __future__ import annotations

import pytest

from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.records import read_run
from tests.weights.helper import load
from tests.weights.test_received_reuse import _received, _sent, _sync
from tests.weights.test_resident_reuse import NAMES, _Model, _tensors

QKV, LATER = NAMES[:3], NAMES[3:]  # captured in the bucket (before the repack); at the sync's end


@pytest.fixture(autouse=True)
def _statistics_at_send(monkeypatch):
    """This module checks the reuse of the sender's statistics, which the sender takes with
    RL_MSPROBE_WEIGHTS_STATS=all; the default, lazy statistics, is tests/weights/test_lazy_statistics.py."""
    monkeypatch.setenv("RL_MSPROBE_WEIGHTS_STATS", "all")


def _first(doc) -> tuple[str, str]:
    first = doc["first_difference"]
    return first["stage"], first["name"]


def test_a_clean_sync_reads_each_fused_part_once_and_compares_equal(tmp_path, monkeypatch):
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1, settles=True)
    assert helper._deferred == {}  # nothing of the bucket's buffer is kept past `settled()`
    sent, got = _sent(tmp_path, 1), _received(tmp_path, 1)
    assert {n: got[n].get("implied_by") for n in NAMES} == {
        **dict.fromkeys(QKV, "resident"),
        **dict.fromkeys(LATER),
    }
    for name in NAMES:
        assert got[name]["same_as"] == "sent" and got[name]["hash"] == sent[name]["hash"], got[name]
        assert got[name]["fp"] == sent[name]["fp"] and got[name]["index"] == sent[name]["index"]
    doc = compare_run(read_run(tmp_path))
    assert doc["verdict"] == "EQUAL", doc["steps"]
    step = doc["steps"][0]
    assert (step["received_reused"], step["received_implied"], step["resident_reused"]) == (5, 3, 5)


def test_a_transfer_fault_is_named_at_received_and_a_loader_fault_at_resident(tmp_path, monkeypatch):
    """Sync 1: k_proj scaled on the wire; sync 2: v_proj permuted on the wire (statistics equal);
    sync 3: the loader scales q_proj; sync 4: the wire scales the norm (checked after the bucket).
    Each altered tensor's received record is measured from what arrived, nothing implied."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    model = _Model(tensors)
    _sync(helper, model, tensors, 1, wire={NAMES[1]: lambda t: t * 1.001}, settles=True)
    _sync(helper, model, tensors, 2, wire={NAMES[2]: lambda t: t.flip(0)}, settles=True)
    model.faults = {NAMES[0]: lambda t: t * 1.001}
    _sync(helper, model, tensors, 3, settles=True)
    model.faults = {}
    _sync(helper, model, tensors, 4, wire={NAMES[3]: lambda t: t * 1.001}, settles=True)

    first, second, third = (_received(tmp_path, s) for s in (1, 2, 3))
    altered = tensors[NAMES[1]] * 1.001
    assert first[NAMES[1]]["fp"] == helper.fingerprint(altered) and "same_as" not in first[NAMES[1]]
    assert first[NAMES[1]]["hash"] == helper.digest(altered)
    assert second[NAMES[2]]["hash"] == helper.digest(tensors[NAMES[2]].flip(0))
    # the loader's fault: what arrived was checksummed, equal to the sender's: reused, not implied
    assert third[NAMES[0]]["same_as"] == "sent" and "implied_by" not in third[NAMES[0]]
    assert [n for n in QKV if third[n].get("implied_by")] == list(QKV[1:])

    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["DIFFERENT"] * 4, doc["steps"]
    differs = {
        (r["sync"], r["name"], stage, r[stage].get("what"))
        for r in doc["tensors"]
        for stage in ("received", "resident")
        if r[stage]["status"] == "differs"
    }
    assert {x[:3] for x in differs} == {
        (1, NAMES[1], "received"),
        (2, NAMES[2], "received"),
        (3, NAMES[0], "resident"),
        (4, NAMES[3], "received"),
    }, differs
    assert (2, NAMES[2], "received", "bits (hash differs, statistics equal in float64)") in differs
    assert _first(doc) == ("received", NAMES[1])
    assert [s["received_implied"] for s in doc["steps"]] == [2, 2, 2, 3]


def test_no_implication_on_a_tp_shard_or_without_the_promise(tmp_path, monkeypatch):
    """TP 2: a rank's resident shard is not the received tensor, so each received tensor is
    checksummed and its chunks measured as before. A plain `arrived` (a receiver that does not call
    `settled()`): nothing waits."""
    tensors = _tensors()
    for folder, model, settles in (
        ("tp2", _Model(tensors, tp=2, rank=1), True),
        ("plain", _Model(tensors), None),
    ):
        helper = load()
        monkeypatch.setenv(helper.ENV, str(tmp_path / folder))
        _sync(helper, model, tensors, 1, settles=settles)
        got = _received(tmp_path / folder, 1)
        assert set(got) == set(NAMES) and not any(x.get("implied_by") for x in got.values()), got
        assert {x.get("same_as") for x in got.values()} == {"sent"}
    assert "shard_fp" in _received(tmp_path / "tp2", 1)[NAMES[0]]
    assert compare_run(read_run(tmp_path / "plain"))["verdict"] == "EQUAL"


def test_a_receiver_that_never_settles_leaves_those_records_missing(tmp_path, monkeypatch, capsys):
    """`arrived(..., settles=True)` without `settled()` (verl-weights-bucket never patches one half
    without the other): the parts checked in the bucket are written (implied), the others are
    dropped at the sync's end with a warning, never checksummed from a buffer that may hold another
    bucket by then: the compare names them at stage received, never EQUAL."""
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    tensors = _tensors()
    _sync(helper, _Model(tensors), tensors, 1, settles="never")
    assert helper._deferred == {}
    assert set(_received(tmp_path, 1)) == set(QKV)
    assert "not settled by the receiver" in capsys.readouterr().err
    doc = compare_run(read_run(tmp_path))
    assert doc["verdict"] != "EQUAL", doc["steps"]
    unequal = {r["name"] for r in doc["tensors"] if r["received"]["status"] != "equal"}
    assert unequal == set(LATER), doc["tensors"]

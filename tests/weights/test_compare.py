"""weights compare over folders written the way a TP-sharded engine writes them (tests/weights/synthetic.py)."""

from __future__ import annotations

import json
import zlib

import pytest

from rl_msprobe.errors import UserError
from rl_msprobe.weights.compare import compare_run
from rl_msprobe.weights.records import read_run
from tests.support.trees import run_cli
from tests.weights import synthetic

K1 = "model.layers.1.self_attn.k_proj.weight"
UP0 = "model.layers.0.mlp.up_proj.weight"
NORM1 = "model.layers.1.input_layernorm.weight"


def doc_of(folder):
    return compare_run(read_run(folder))


@pytest.mark.parametrize("tp,kv", [(1, 2), (2, 2), (4, 2)])
def test_identical_weights_are_equal_with_every_tensor_accounted_for(tmp_path, tp, kv):
    doc = doc_of(synthetic.write(tmp_path / "w", tp=tp, kv=kv))
    assert doc["verdict"] == "EQUAL" and doc["first_difference"] is None
    for step in doc["steps"]:
        assert step["verdict"] == "EQUAL"
        assert step["sent_tensors"] == step["model_tensors"] == len(synthetic.model())
        assert step["counts"]["tied"] == 1
    kv_rows = [r for r in doc["tensors"] if r["name"] == K1]
    assert all(r["replicas"] == max(1, tp // kv) for r in kv_rows)


@pytest.mark.parametrize("name,rank", [(K1, 1), (NORM1, 0), ("model.layers.0.self_attn.o_proj.weight", 1)])
def test_a_loader_fault_on_one_rank_is_that_tensor_at_stage_resident(tmp_path, name, rank):
    doc = doc_of(synthetic.write(tmp_path / "w", syncs=3, faults=[(2, "resident", name, rank, 1.001)]))
    assert doc["verdict"] == "DIFFERENT"
    first = doc["first_difference"]
    assert (first["sync"], first["name"], first["stage"]) == (2, name, "resident")
    differs = [
        (r["sync"], r["name"], s)
        for r in doc["tensors"]
        for s in ("received", "resident")
        if r[s]["status"] == "differs"
    ]
    assert differs == [(2, name, "resident")]
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT", "EQUAL"]
    # the faulty rank by name: a sharded part against that rank's chunk of what it received (dim 0
    # for k_proj, dim 1 for the row-parallel o_proj), a replicated norm against the whole tensor
    assert first["faulty_ranks"] == [rank] and first["ranks"] == [0, 1], first
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"))
    assert f"stage resident, on rank {rank} (of [0, 1])" in out, out


@pytest.mark.parametrize("tp,kv,name,ranks", [(4, 4, K1, [2]), (4, 2, UP0, [1, 3]), (4, 2, K1, None)])
def test_the_faulty_rank_is_named_where_its_part_can_be_told(tmp_path, tp, kv, name, ranks):
    """TP 4: a k_proj shard, an up_proj fault on two ranks; with KV heads replicated (TP > KV heads)
    a rank's k_proj part is no 1/TP chunk of what it received: the ranks holding it, no guess."""
    faults = [(1, "resident", name, r, 1.001) for r in (ranks or [3])]
    doc = doc_of(synthetic.write(tmp_path / "w", syncs=1, tp=tp, kv=kv, faults=faults))
    first = doc["first_difference"]
    assert (first["name"], first["stage"], first.get("faulty_ranks")) == (name, "resident", ranks), first
    assert first["ranks"] == list(range(tp)) if ranks else len(first["ranks"]) == tp, first


def test_a_transfer_fault_is_that_tensor_at_stage_received(tmp_path):
    doc = doc_of(synthetic.write(tmp_path / "w", syncs=3, faults=[(3, "received", UP0, None, 1.001)]))
    differs = [
        (r["sync"], r["name"], s)
        for r in doc["tensors"]
        for s in ("received", "resident")
        if r[s]["status"] == "differs"
    ]
    assert differs == [(3, UP0, "received")]
    first = doc["first_difference"]
    assert (first["step"], first["name"], first["stage"], first["ranks"]) == (2, UP0, "received", [0, 1])


def test_a_bit_flip_the_statistics_miss_is_caught_by_the_hash(tmp_path):
    folder = synthetic.write(tmp_path / "w", syncs=1)
    path = folder / "received-host-201.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[3]["hash"] = "k64:" + "0" * 16
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    first = doc_of(folder)["first_difference"]
    assert first["stage"] == "received" and first["ranks"] == [1] and "hash" in first["what"]


def _rewrite_hashes(folder, new_hash) -> None:
    for path in folder.glob("*.jsonl"):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for line in lines:
            if line.get("hash"):
                line["hash"] = new_hash(line)
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_crc32_folders_of_older_helpers_still_compare_and_are_never_mixed_with_k64(tmp_path):
    """FORMAT 1 helpers wrote bare CRC-32s (8 hex): such a folder compares as before, bit flips
    included; a folder holding both kinds is refused, naming a line of each, never compared."""
    old = synthetic.write(tmp_path / "old", syncs=1)
    _rewrite_hashes(old, lambda line: f"{zlib.crc32(line['name'].encode()):08x}")  # one per tensor
    assert doc_of(old)["verdict"] == "EQUAL"
    path = old / "received-host-201.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[3]["hash"] = "0" * 8
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "hash" in doc_of(old)["first_difference"]["what"]
    mixed = synthetic.write(tmp_path / "mixed", syncs=1)
    _rewrite_hashes(mixed, lambda line: line["hash"] if line["stage"] == "sent" else "1234abcd")
    with pytest.raises(UserError) as err:
        read_run(mixed)
    assert "crc32 (received-host-" in str(err.value) and "k64 (sent-host-" in str(err.value)


def test_a_tensor_never_sent_is_not_synced_by_name_shape_and_rank(tmp_path):
    """The engine holds it, every rank received other tensors but not this one: the sync never
    wrote it (a name-mapping miss, a forgotten expert), which used to read as nothing wrong."""
    doc = doc_of(synthetic.write(tmp_path / "w", drop_sent=("model.norm.weight",)))
    assert doc["verdict"] == "DIFFERENT"
    rows = [r for r in doc["tensors"] if r["name"] == "model.norm.weight"]
    assert rows and all(r["resident"]["status"] == "not-synced" for r in rows)
    assert [(x["sync"], x["name"], x["shape"], x["ranks"]) for x in doc["not_synced"]] == [
        (1, "model.norm.weight", [16], [0, 1]),
        (2, "model.norm.weight", [16], [0, 1]),
    ]
    assert "received other tensors in this sync but not this one" in doc["not_synced"][0]["why"]
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"))
    assert code == 1 and "sync 1 NOT SYNCED: model.norm.weight shape [16] on ranks [0, 1]" in out, out


def test_a_tensor_only_one_rank_did_not_receive_is_not_synced_on_that_rank(tmp_path):
    folder = synthetic.write(tmp_path / "w", syncs=1)
    path = folder / "received-host-201.jsonl"  # rank 1
    path.write_text("".join(x for x in path.read_text().splitlines(True) if f'"{NORM1}"' not in x))
    doc = doc_of(folder)
    (x,) = doc["not_synced"]
    assert (x["name"], x["ranks"]) == (NORM1, [1])


def test_reset_mode_names_what_the_loader_left_holding_the_pattern(tmp_path):
    """Sent and received, but the loader skipped it on rank 0 (reset mode: it still holds the pattern)."""
    doc = doc_of(synthetic.write(tmp_path / "w", syncs=2, reset={1}, kept={(1, NORM1, 0)}))
    assert [s["verdict"] for s in doc["steps"]] == ["DIFFERENT", "EQUAL"]
    (x,) = doc["not_synced"]
    assert (x["sync"], x["name"], x["ranks"]) == (1, NORM1, [0]) and "reset pattern" in x["why"]
    # a reset sync where the loader wrote everything: nothing is named
    clean = doc_of(synthetic.write(tmp_path / "clean", syncs=1, reset={1}))
    assert clean["verdict"] == "EQUAL" and clean["not_synced"] == []


def test_cli_json_exit_codes_and_reports(tmp_path):
    folder = synthetic.write(tmp_path / "w", syncs=2, faults=[(2, "resident", K1, 1, 1.001)])
    code, out, _ = run_cli("weights", "compare", str(folder), "--out", str(tmp_path / "r"), "--json")
    doc = json.loads(out)
    assert code == 1 and set(doc) >= {"verdict", "steps", "tensors", "first_difference"}
    assert doc["first_difference"]["name"] == K1
    md = (tmp_path / "r" / "weights.md").read_text()
    assert "| 1 | 0 | EQUAL |" in md and "X" in md
    assert "<table" in (tmp_path / "r" / "weights.html").read_text()
    code, out, _ = run_cli(
        "weights", "compare", str(synthetic.write(tmp_path / "ok")), "--out", str(tmp_path / "r")
    )
    assert code == 0 and out.strip().endswith("EQUAL")  # its own report files are replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.md").write_text("my notes\n")
    code, _, err = run_cli("weights", "compare", str(folder), "--out", str(tmp_path / "mine"))
    assert (
        code == 2
        and "Nothing was written" in err
        and (tmp_path / "mine" / "weights.md").read_text() == "my notes\n"
    )


def test_bad_input_names_file_and_line(tmp_path):
    folder = synthetic.write(tmp_path / "w", syncs=1)
    with (folder / "sent-host-100.jsonl").open("a") as out:
        out.write('{"stage": "sent", "sync": 1}\n')
    with pytest.raises(UserError, match=r"sent-host-100.jsonl:\d+: key 'rank' missing"):
        read_run(folder)
    code, _, err = run_cli("weights", "compare", str(tmp_path / "empty"))
    assert code == 2 and "not a folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("weights", "compare", str(tmp_path / "empty"))
    assert code == 2 and "RL_MSPROBE_WEIGHTS_DIR" in err


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"how": ["loader-written"]}', r"how is \[\"loader-written\"\], not a string"),
        ('{"engine_name": 7}', "engine_name is 7, not a string"),
        ('{"hash": 5}', "hash is 5, not a string"),
        ('{"step": "3"}', 'step is "3", not a whole number'),
        ('{"stage": "resident-meta", "aliases": [1]}', r"aliases is \[1\], not an object of tensor names"),
        (
            '{"stage": "resident-meta", "aliases": {"lm_head.weight": 0}}',
            "aliases is .*not an object of tensor names",
        ),
        ('{"stage": "resident-meta", "tp_size": "2"}', 'tp_size is "2", not a whole number'),
        ('{"stage": "resident-meta", "holds": "x"}', 'holds is "x", not a list of tensor names'),
    ],
)
def test_every_field_compare_reads_is_checked(tmp_path, line, message):
    """A field of the wrong type is bad input naming file, line and key (it used to reach compare:
    an unhashable `how` or a list of aliases was a traceback, a text tp_size a silent wrong shard)."""
    folder = synthetic.write(tmp_path / "w", syncs=1)
    first = (folder / "resident-host-200.jsonl").read_text().splitlines()[0]
    with (folder / "resident-host-200.jsonl").open("a") as out:
        out.write(json.dumps({**json.loads(first), **json.loads(line)}) + "\n")
    with pytest.raises(UserError, match=rf"resident-host-200.jsonl:\d+: {message}"):
        read_run(folder)


def test_a_tensor_still_unloaded_when_the_sync_returned_is_not_synced(tmp_path):
    """An engine that reloads layer by layer (vLLM's reload: parameters on meta until loaded) has no
    resident record of what it was not given; the helper's meta line lists it as unwritten, and the
    next sync's start lists what still holds reset mode's pattern."""
    folder = synthetic.write(tmp_path / "w", syncs=2)
    path = folder / "resident-host-200.jsonl"  # rank 0
    lines = [x for x in path.read_text().splitlines(True) if not (f'"{NORM1}"' in x and '"sync": 1,' in x)]
    lines.append(
        json.dumps({"stage": "resident-meta", "sync": 1, "rank": 0, "tp_size": 2, "unwritten": [NORM1]})
        + "\n"
    )
    lines.append(
        json.dumps({"stage": "resident-meta", "sync": 1, "rank": 0, "tp_size": 2, "reset_kept": [NORM1]})
        + "\n"
    )
    path.write_text("".join(lines))
    doc = doc_of(folder)
    (x,) = doc["not_synced"]
    assert (x["sync"], x["name"], x["shape"], x["ranks"]) == (1, NORM1, [16], [0])
    assert "had not loaded it when the sync returned" in x["why"] and "reset pattern" in x["why"]
    assert [s["verdict"] for s in doc["steps"]] == ["DIFFERENT", "EQUAL"]
    # the meta lines merged, not replaced: the tied lm_head is still accounted for
    assert doc["steps"][0]["counts"]["tied"] == 1

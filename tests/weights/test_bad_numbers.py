"""Fingerprint numbers the helper never writes are bad input (exit 2 naming file, line, tensor, key
and value), never a verdict: NaN / Inf / 1e400 statistics used to read as EQUAL, a negative count
was a traceback, shapes were never checked (issues 34 and 35)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.trees import run_cli
from tests.weights import synthetic

EMBED = "model.layers.0.mlp.up_proj.weight"  # [32, 16]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("weights") / "w", syncs=2, tp=2)


def _edit(folder: Path, file: str, name: str, sync: int, change, raw: dict[str, str] | None = None) -> int:
    """Rewrite the line of NAME in SYNC of FILE with change(doc); RAW: '"@key@"' placeholders
    replaced by raw JSON text (NaN, 1e400: what json.dumps cannot write). Returns the line number."""
    path = folder / file
    lines = path.read_text().splitlines(keepends=True)
    for number, text in enumerate(lines, 1):
        doc = json.loads(text)
        if doc.get("name") == name and doc.get("sync") == sync:
            change(doc)
            out = json.dumps(doc)
            for marker, token in (raw or {}).items():
                out = out.replace(f'"{marker}"', token)
            lines[number - 1] = out + "\n"
            path.write_text("".join(lines))
            return number
    raise AssertionError(f"{name} not in {file}")


def _fp(key: str, value: object):
    def change(doc: dict) -> None:
        doc["fp"][key] = value

    return change


def _scaled(key: str, factor: float):
    def change(doc: dict) -> None:
        doc["fp"][key] = doc["fp"][key] * factor

    return change


RAW = [  # (case, key, raw JSON token, what the message says)
    ("sum NaN", "sum", "NaN", "fp.sum is nan, not a finite number"),
    ("sum Infinity", "sum", "Infinity", "fp.sum is inf, not a finite number"),
    ("sum -Infinity", "sum", "-Infinity", "fp.sum is -inf, not a finite number"),
    ("sum 1e400", "sum", "1e400", "fp.sum is inf, not a finite number"),
    ("sumsq NaN", "sumsq", "NaN", "fp.sumsq is nan, not a finite number"),
    ("sumsq 1e400", "sumsq", "1e400", "fp.sumsq is inf, not a finite number"),
    ("sumsq -1e400", "sumsq", "-1e400", "fp.sumsq is -inf, not a finite number"),
    ("min NaN", "min", "NaN", "fp.min is nan, not a finite number"),
    ("max Infinity", "max", "Infinity", "fp.max is inf, not a finite number"),
    ("count 1e400", "count", "1e400", "fp.count is inf, not a whole number"),
    ("count huge", "count", "1" + "0" * 30, "fp.count is 1000000000000000000000000000000, outside 0..2"),
]


@pytest.mark.parametrize(
    "stage_file", ["sent-host-100.jsonl", "received-host-201.jsonl", "resident-host-200.jsonl"]
)
@pytest.mark.parametrize("case,key,token,message", RAW, ids=[r[0] for r in RAW])
def test_non_finite_statistics_are_bad_input_not_equal(
    clean, tmp_path, stage_file, case, key, token, message
):
    folder = shutil.copytree(clean, tmp_path / "w")
    number = _edit(folder, stage_file, EMBED, 2, _fp(key, "@x@"), {"@x@": token})
    code, out, err = run_cli("weights", "compare", str(folder))
    assert code == 2, (case, out, err)
    assert f"{stage_file}:{number}: tensor {EMBED!r}: {message}" in err
    assert "EQUAL" not in out and "DIFFERENT" not in out


KINDS = [  # (case, file, change, what the message says)
    ("negative count", "sent-host-100.jsonl", _fp("count", -1), "fp.count is -1, outside 0..2**53"),
    ("fractional count", "sent-host-100.jsonl", _fp("count", 1.5), "fp.count is 1.5, not a whole number"),
    ("count true", "received-host-200.jsonl", _fp("count", True), "fp.count is true, not a whole number"),
    ("negative sumsq", "received-host-200.jsonl", _fp("sumsq", -2.0), "fp.sumsq is -2.0, negative"),
    ("sum as text", "sent-host-100.jsonl", _fp("sum", "0.5"), 'fp.sum is "0.5", not a number'),
    ("negative nan count", "resident-host-201.jsonl", _fp("nan", -3), "fp.nan is -3, outside"),
    ("more NaN than elements", "sent-host-100.jsonl", _fp("nan", 10**6), "NaN and 0 Inf in"),
    ("min above max", "sent-host-100.jsonl", _fp("min", 1e3), "fp.min 1000.0 is above max"),
    ("max missing", "sent-host-100.jsonl", _fp("max", None), "fp.min / max are"),
    ("sum beyond the norm", "received-host-201.jsonl", _scaled("sum", 1e9), "exceeds sqrt(n * sumsq)"),
    ("max beyond the norm", "resident-host-200.jsonl", _fp("max", 1e9), "exceeds sqrt(sumsq)"),
    ("fp not an object", "sent-host-100.jsonl", lambda d: d.update(fp=[1, 2]), "fp is [1, 2], not an object"),
]


@pytest.mark.parametrize("case,file,change,message", KINDS, ids=[k[0] for k in KINDS])
def test_out_of_range_statistics_are_bad_input(clean, tmp_path, case, file, change, message):
    folder = shutil.copytree(clean, tmp_path / "w")
    number = _edit(folder, file, EMBED, 1, change)
    code, out, err = run_cli("weights", "compare", str(folder))
    assert code == 2, (case, out, err)
    assert f"{file}:{number}: tensor {EMBED!r}: " in err and message in err, err
    assert "Traceback" not in err and "EQUAL" not in out


def _set(key: str, value: object):
    return lambda doc: doc.update({key: value})


def _shard(dim: str, key: str, value: object):
    def change(doc: dict) -> None:
        doc["shard_fp"][dim][key] = value

    return change


SHAPES = [  # (case, file, sync, change, what the message says)
    (
        "shape against count",
        "sent-host-100.jsonl",
        1,
        _set("shape", [32, 17]),
        "shape [32, 17] holds 544 elements",
    ),
    (
        "negative dim",
        "received-host-200.jsonl",
        1,
        _set("shape", [-32, -16]),
        "shape is [-32, -16], not a list",
    ),
    ("shape as text", "resident-host-200.jsonl", 1, _set("shape", "32x16"), 'shape is "32x16", not a list'),
    (
        "received transposed",
        "received-host-201.jsonl",
        1,
        _set("shape", [16, 32]),
        "shape [16, 32] at stage received, but [32, 16] at received-host-200.jsonl:",
    ),
    (
        "sent reshaped next sync",
        "sent-host-100.jsonl",
        2,
        _set("shape", [64, 8]),
        "shape [64, 8] at stage sent, but [32, 16] at ",
    ),
    (
        "resident dtype of one rank",
        "resident-host-201.jsonl",
        1,
        _set("dtype", "bfloat16"),
        "dtype 'bfloat16' at stage resident, but 'float32'",
    ),
    (
        "sent dtype next sync",
        "sent-host-100.jsonl",
        2,
        _set("dtype", "float16"),
        "dtype 'float16' at stage sent, but 'float32'",
    ),
    ("dtype not a name", "sent-host-100.jsonl", 1, _set("dtype", 32), "dtype is 32, not a dtype name"),
    (
        "shard count",
        "received-host-200.jsonl",
        1,
        _shard("0", "count", 100),
        "shard_fp.0.count is 100, not 1/2",
    ),
    (
        "shard sum NaN",
        "received-host-200.jsonl",
        1,
        _shard("1", "sum", float("nan")),
        "shard_fp.1.sum is nan",
    ),
    (
        "shard dim",
        "received-host-200.jsonl",
        1,
        lambda d: d["shard_fp"].update({"5": d["shard_fp"]["0"]}),
        'shard_fp has dim "5"',
    ),
]


@pytest.mark.parametrize("case,file,sync,change,message", SHAPES, ids=[s[0] for s in SHAPES])
def test_shapes_and_dtypes_must_agree(clean, tmp_path, case, file, sync, change, message):
    folder = shutil.copytree(clean, tmp_path / "w")
    number = _edit(folder, file, EMBED, sync, change)
    code, out, err = run_cli("weights", "compare", str(folder))
    assert code == 2, (case, out, err)
    assert f"{file}:{number}: tensor {EMBED!r}: " in err and message in err, err
    assert "EQUAL" not in out


def test_nan_elements_counted_by_the_helper_are_a_finding_not_bad_input(clean, tmp_path):
    """NaN / Inf *elements* are what the helper counts (`nan`, `inf`): a received tensor with NaNs
    the actor did not send is DIFFERENT, exit 1, not refused."""
    folder = shutil.copytree(clean, tmp_path / "w")

    def nan_elements(doc: dict) -> None:
        doc["fp"]["nan"] = 2

    _edit(folder, "received-host-200.jsonl", EMBED, 1, nan_elements)
    code, out, err = run_cli("weights", "compare", str(folder))
    assert code == 1 and "DIFFERENT" in out and not err, (out, err)

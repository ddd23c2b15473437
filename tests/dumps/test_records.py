"""The records reader (rl_msprobe/dumps/records.py) on hostile inputs: never CONSISTENT, never a
traceback; a clear error naming the file and field, or NOT COMPARED naming the request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rl_msprobe.dumps import record_compare, records  # noqa: E402
from rl_msprobe.errors import UserError  # noqa: E402
from tests.dumps import record_models as rm  # noqa: E402
from tests.support.records import load_header

LENGTHS = {"A": (3, 3), "B": (2, 4)}


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return rm.write_job(
        tmp_path / "rec", rm.tokens_of(LENGTHS), {}, rm.batched_schedule(LENGTHS), [["A", "B"]]
    )


def compare(root: Path) -> record_compare.RecordJob:
    return record_compare.compare_job(records.find([root]) or {})


def first_record(root: Path, side: str = "rollout") -> Path:
    return sorted((root / side).glob("*/rec0.json"))[0]


def set_value(header: Path, tensor_part: str, stat: int, value: float) -> None:
    import numpy as np

    head = load_header(header)
    t = next(t for t in head["tensors"] if tensor_part in t["key"] and t["label"] == "output.0")
    rows = sum(c for _, _, c in head["token_rows"]) if t["rows"] == "token" else len(head["sample_rows"])
    data = np.fromfile(header.with_suffix(".f32"), dtype="<f4")
    data[t["offset"] + stat * rows] = value
    data.tofile(header.with_suffix(".f32"))


def test_the_root_its_parent_and_the_side_folders_are_found(job: Path) -> None:
    assert records.find([job]) == {"rollout": job / "rollout", "train": job / "train"}
    assert records.find([job.parent]) == records.find([job])
    assert records.find([job / "rollout", job / "train"]) == records.find([job])
    assert records.find([job / "rollout" / "1000"]) is None
    assert all(r.status == "consistent" for r in compare(job).results)


@pytest.mark.parametrize(
    ("stat", "value", "words"),
    [
        (2, float("nan"), "not a finite number"),
        (2, -1.0, "a negative norm"),
        (0, float("inf"), "not a finite"),
        (0, -50.0, "a Max below its Min"),
    ],
)
def test_bad_numbers_are_not_compared_naming_file_tensor_and_position(
    job: Path, stat: int, value: float, words: str
) -> None:
    header = first_record(job)
    set_value(header, "layers.0.mlp.down_proj", stat, value)
    result = {r.request_id: r for r in compare(job).results}["A"]
    assert result.status == "not compared"
    text = result.verdict()
    assert (
        words in text
        and str(header.with_suffix(".f32")) in text
        and "down_proj" in text
        and "position 0" in text
    )


def test_a_cut_record_is_an_error_naming_the_file(job: Path) -> None:
    data = first_record(job).with_suffix(".f32")
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(UserError, match=r"rec0\.f32: .* bytes where its header"):
        compare(job)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda h: h.update(format="rl-msprobe-records/9"), "`format`"),
        (lambda h: h.update(token_rows=[[0, "x", 1]]), "`token_rows[0]`"),
        (lambda h: h.update(token_rows=[[5, 0, 1]]), "request index"),
        (lambda h: h["tensors"][0].update(offset=7), "`offset`"),
        (lambda h: h["tensors"][1].update(width="8"), "`width`"),
        (lambda h: h["tensors"][0].update(key="garbage"), "`key`"),
        (lambda h: h.update(tp_rank=3), "`tp_rank`"),
        (lambda h: h.update(side="train"), "`side`"),
    ],
)
def test_a_header_that_is_not_the_format_is_an_error_naming_the_field(job: Path, edit, field: str) -> None:
    header = first_record(job)
    head = load_header(header)
    head.pop("schema")  # the table inline, as the reader also accepts it, so the edit reaches it
    edit(head)
    header.write_text(json.dumps(head))
    with pytest.raises(UserError, match="rec0.json") as info:
        compare(job)
    assert field in str(info.value)


def test_garbage_and_unreadable_headers_are_errors(job: Path) -> None:
    header = first_record(job)
    header.write_bytes(b"\x00\xffnot json")
    with pytest.raises(UserError, match="not JSON"):
        compare(job)
    header.write_text("[1, 2]")
    with pytest.raises(UserError, match="not a JSON object"):
        compare(job)
    if os.geteuid() != 0:
        header.write_text("{}")
        header.chmod(0)
        with pytest.raises(UserError, match="cannot be read"):
            compare(job)


def test_a_header_without_data_is_an_error_and_data_without_header_is_counted(job: Path) -> None:
    header = first_record(job, "train")
    header.with_suffix(".f32").unlink()
    with pytest.raises(UserError, match="without its data file"):
        compare(job)


def test_a_request_on_one_side_only_is_named(tmp_path: Path) -> None:
    root = rm.write_job(tmp_path / "rec", rm.tokens_of(LENGTHS), {}, rm.batched_schedule(LENGTHS), [["A"]])
    found = compare(root)
    assert [r.request_id for r in found.results] == ["A"] and found.only["rollout"] == ("B",)
    assert "recorded on the rollout side only (not compared): B" in found.notes()


def test_a_missing_or_foreign_tensor_table_is_an_error_naming_the_record(job: Path) -> None:
    header = first_record(job)
    table = header.parent / f"schema{json.loads(header.read_text())['schema']}.json"
    text = table.read_text()
    table.write_text(json.dumps({"format": "something else", "schema": 0, "tensors": []}))
    with pytest.raises(UserError, match="not tensor table"):
        compare(job)
    table.unlink()
    with pytest.raises(UserError, match=r"rec0\.json: its tensor table schema\d+\.json cannot be read"):
        compare(job)
    table.write_text(text)

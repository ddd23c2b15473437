"""`mismatch report`: a step, batch row or prompt length that is not a whole number in range is bad
input (exit 2 naming file, line, key and value), never a report with a step `Infinity` or `2.5`
in it. A line cut short stays an unreadable line, counted; a NaN log-prob stays a finding."""

from __future__ import annotations

import json

import pytest

from tests.support.trees import run_cli
from tests.triage.test_report import write_log

VALUES = ["Infinity", "-Infinity", "NaN", "1e400", "-1", "2.5", "1e30", "1" + "0" * 30]
SHOWN = {"1e400": "Infinity", "1e30": "1e+30", "1" + "0" * 30: "1" + "0" * 30}


@pytest.mark.parametrize("key", ["step", "index", "prompt_len"])
@pytest.mark.parametrize("value", VALUES)
def test_numbers_that_are_not_whole_or_in_range_are_bad_input(tmp_path, key, value) -> None:
    folder = tmp_path / "triage"
    write_log(folder, steps=2, per_step=4)
    log = folder / "123" / "triage.jsonl"
    lines = log.read_text().splitlines()
    doc = json.loads(lines[5])
    doc[key] = "@@"
    lines[5] = json.dumps(doc).replace('"@@"', value)
    log.write_text("\n".join(lines) + "\n")
    out_dir = tmp_path / "report"
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(out_dir))
    assert code == 2, (out, err)
    assert f"triage.jsonl:6: `{key}` is {SHOWN.get(value, value)};" in err, err
    assert not out_dir.exists()


def test_whole_numbers_written_as_floats_and_text_steps_still_read(tmp_path) -> None:
    folder = tmp_path / "triage"
    write_log(folder, steps=2, per_step=4)
    log = folder / "123" / "triage.jsonl"
    lines = log.read_text().splitlines()
    docs = [json.loads(x) for x in lines]
    docs[0]["step"], docs[1]["index"], docs[2]["prompt_len"] = 1.0, 1.0, None
    log.write_text("".join(json.dumps(d) + "\n" for d in docs))
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(tmp_path / "r"))
    assert code == 0, err

"""Whole-response consistency as the live job dumps it (issue 32): the rollout's every step in
msprobe statistics mode (the prefill one span, each decode step one position), the training
forward as the per-token record of rl-msprobe's verl engine hook (`PositionRecorder`,
`DUMP_POSITIONS=1`), both made by position_standin.py on CPU with real msprobe and transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl_msprobe.dumps import positions, whole_response
from rl_msprobe.errors import UserError
from tests.dumps.conftest import PLANT_DECODE, PLANT_PREFILL, step_dumps

PROMPT, RESPONSE = 8, 6  # position_standin.PROMPT / RESPONSE


def _record(root: Path) -> positions.Forward:
    (path,) = sorted((root / "positions").glob("*/forward*.json"))
    return positions.read_forward(path)


def _compare(rollout: Path, train: Path, decodes: bool = True) -> positions.Result:
    steps = [positions.read_forward(s[0]) for s in step_dumps(rollout)]
    return positions.compare_request(steps[0], steps[1:] if decodes else [], _record(train))


def test_the_record_is_per_token_with_every_module_of_the_forward(position_dumps: dict[str, Path]) -> None:
    record = _record(position_dumps["record"])
    assert record.task == positions.PER_TOKEN
    head = json.loads(record.path.read_text())
    assert head["tokens"] == PROMPT + RESPONSE and head["request_ids"] == ["request-0"]
    down = next(
        v for k, v in record.data.items() if ".layers.1.mlp.down_proj." in k.replace(positions.WRAP, "")
    )
    leaf = down["output"][0]
    assert leaf["token_axis"] == 1 and len(leaf["per_token"]["Norm"]) == PROMPT + RESPONSE
    # the record's whole-tensor statistics agree with its rows
    assert leaf["Max"] == max(leaf["per_token"]["Max"]) and leaf["Min"] == min(leaf["per_token"]["Min"])


def test_clean_statistics_rollout_is_consistent_at_every_position(position_dumps: dict[str, Path]) -> None:
    r = _compare(position_dumps["stats_clean"], position_dumps["record"])
    assert r.status == "consistent", r.verdict()
    # the prefill in statistics mode is one span; each decode step is its position
    assert [(p.start, p.stop, p.phase) for p in r.positions] == [(0, PROMPT, "prefill")] + [
        (PROMPT + k, PROMPT + k + 1, "decode") for k in range(RESPONSE - 1)
    ]
    assert max(j.error for p in r.positions for j in p.judgements) < 1e-5
    assert {len(p.judgements) for p in r.positions} == {21}
    assert r.verdict().startswith("CONSISTENT at every position: 6 position span(s) (prompt 8, response 6)")


def test_a_decode_only_plant_is_at_the_first_response_position_and_invisible_to_the_prefill(
    position_dumps: dict[str, Path],
) -> None:
    r = _compare(position_dumps["stats_decode_plant"], position_dumps["record"])
    first = r.first
    assert first is not None, r.verdict()
    where, j = first
    assert (where.start, where.phase, j.module, j.tensor) == (
        PROMPT,
        "decode",
        PLANT_DECODE["plant"],
        "output.0",
    )
    assert j.error == pytest.approx(0.01, rel=0.05) and j.floor_ratio > 50
    assert "response position 0" in r.verdict()
    # the same dumps cut to the prefill, as a prefill-only compare sees them: nothing
    only = _compare(position_dumps["stats_decode_plant"], position_dumps["record"], decodes=False)
    assert only.status == "consistent", only.verdict()


def test_a_prefill_only_plant_is_inside_the_prompt(position_dumps: dict[str, Path]) -> None:
    r = _compare(position_dumps["stats_prefill_plant"], position_dumps["record"])
    first = r.first
    assert first is not None, r.verdict()
    where, j = first
    assert (where.start, where.stop, where.phase, j.module) == (0, PROMPT, "prefill", PLANT_PREFILL["plant"])
    # later positions attend over the keys and values the faulty prefill left in the cache: the
    # decode steps may carry its effect, but the first divergence is the prompt's
    assert "positions 0-7 (prefill, statistics)" in r.verdict()


def test_other_token_ids_are_not_compared_naming_the_position(position_dumps: dict[str, Path]) -> None:
    r = _compare(position_dumps["stats_clean"], position_dumps["record_flip"])
    assert r.status == "not compared" and r.ids_mismatch and "position 10" in r.ids_mismatch


def test_a_record_shorter_than_the_response_is_not_said_to_differ(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    """The training record's token ids end at position 10 (a record cut short): the ids there are
    not recorded, which is no difference of token ids."""
    shutil.copytree(position_dumps["record"], tmp_path / "record")
    (path,) = sorted((tmp_path / "record" / "positions").glob("*/forward*.json"))
    doc = json.loads(path.read_text())

    def cut(value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key == "per_token" and isinstance(inner, dict):
                    value[key] = {k: v[:10] if isinstance(v, list) else v for k, v in inner.items()}
                else:
                    cut(inner)
        elif isinstance(value, list):
            for inner in value:
                cut(inner)

    cut({k: v for k, v in doc["data"].items() if "embed_tokens" in k})
    path.write_text(json.dumps(doc))
    r = _compare(position_dumps["stats_clean"], tmp_path / "record")
    assert r.status == "not compared" and "differ" not in r.verdict(), r.verdict()
    assert "token ids are not recorded at position 10 on the training side" in r.verdict(), r.verdict()


def _job(tmp: Path, rollout: Path, train: Path, rid: str = "request-0-1a2b3c4d") -> tuple[Path, Path]:
    """A job's two dump roots: the rollout steps under one pid with the dispatch log the vLLM dump
    helper writes (the vLLM suffix on the id), the training side's record."""
    gen, actor = tmp / "generate", tmp / "actor"
    pid = gen / "4242"
    lines = []
    for k, files in enumerate(step_dumps(rollout)):
        (pid / f"step{k}").mkdir(parents=True)
        shutil.copytree(files[0].parent, pid / f"step{k}" / "rank0")
        phase, tokens = ("prefill", PROMPT) if k == 0 else ("decode", 1)
        kind = "new" if k == 0 else "cached"
        lines.append(
            {
                "source": "vllm",
                "pid": 4242,
                "rank": 0,
                "step": k,
                "tp_rank": 0,
                "tp_size": 1,
                "phase": phase,
                "total_num_scheduled_tokens": tokens,
                "requests": [{"request_id": rid, "type": kind, "tokens": tokens}],
            }
        )
    (pid / "dispatch_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    actor.mkdir()
    shutil.copytree(train / "positions", actor / "positions")
    return gen, actor


def test_the_job_is_joined_on_the_request_id(position_dumps: dict[str, Path], tmp_path: Path) -> None:
    gen, actor = _job(tmp_path, position_dumps["stats_decode_plant"], position_dumps["record"])
    (result,) = whole_response.compare_job(gen, actor, tmp_path / "work")
    assert result.request_id == "request-0" and result.status == "divergent", result.verdict()
    assert result.result is not None and result.result.first is not None
    assert result.result.first[0].start == PROMPT
    status, verdict = whole_response.summary([result])
    assert status == "divergent" and verdict.startswith("DIVERGENT (1 of 1 request(s)): request-0:")


def test_a_request_without_rollout_steps_is_not_compared(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    gen, actor = _job(tmp_path, position_dumps["stats_clean"], position_dumps["record"], rid="other")
    (result,) = whole_response.compare_job(gen, actor, tmp_path / "work")
    assert result.status == "not compared" and "no rollout step of request request-0" in result.verdict()


def test_no_records_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "gen" / "1").mkdir(parents=True)
    (tmp_path / "gen" / "1" / "dispatch_log.jsonl").write_text("")
    (tmp_path / "actor").mkdir()
    with pytest.raises(UserError, match="no per-token records .*DUMP_POSITIONS=1"):
        whole_response.compare_job(tmp_path / "gen", tmp_path / "actor", tmp_path / "work")


def test_the_command_writes_the_report_and_exits_1_on_a_divergence(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from rl_msprobe.cli import main

    gen, actor = _job(tmp_path, position_dumps["stats_decode_plant"], position_dumps["record"])
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["dumps", "positions", str(gen), str(actor), "--out", str(out), "--json"]
    )
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    assert doc["status"] == "divergent" and doc["bytes"]["train_records"] > 0
    md = (out / "positions.md").read_text()
    assert doc["verdict"] in md and "response position 0" in md
    assert json.loads((out / "positions.json").read_text())["requests"][0]["request_id"] == "request-0"
    # a second run replaces its own report; a clean job exits 0
    gen2, actor2 = _job(tmp_path / "clean", position_dumps["stats_clean"], position_dumps["record"])
    again = CliRunner().invoke(main, ["dumps", "positions", str(gen2), str(actor2), "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert "CONSISTENT (1 request(s))" in again.output

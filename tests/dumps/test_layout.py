"""`dumps check`: the layout of each mode, and what it reports as a problem."""

from __future__ import annotations

from pathlib import Path

from rl_msprobe.dumps.layout import DumpIndex, check_layout, detect_mode, parse_dump_path
from tests.dumps.conftest import write_dump


def _whats(report) -> list[str]:
    return [f"{p['where']}: {p['what']}" for p in report.problems]


def test_parse_dump_path_levels(tmp_path: Path) -> None:
    ref = parse_dump_path(tmp_path, tmp_path / "1234" / "step3" / "rank2" / "dump.json")
    assert (ref.pid, ref.step, ref.rank, ref.proc) == (1234, 3, 2, None)
    ref = parse_dump_path(tmp_path, tmp_path / "step0" / "proc77" / "dump.json")
    assert (ref.pid, ref.step, ref.rank, ref.proc, ref.rank_label) == (None, 0, None, 77, "proc77")
    ref = parse_dump_path(tmp_path, tmp_path / "step_5" / "actor_update" / "step0" / "rank1" / "dump.json")
    assert (ref.global_step, ref.stage, ref.step, ref.rank) == (5, "actor_update", 0, 1)
    assert (
        parse_dump_path(tmp_path, tmp_path / "step_0" / "rank_0" / "dump.json") is None
    )  # doc drawing, not msprobe


def test_training_layout_complete(tmp_path: Path) -> None:
    for g in (1, 2):
        for stage in ("actor_compute_log_prob", "actor_update"):
            for rank in (0, 1):
                write_dump(tmp_path / f"step_{g}" / stage / "step0" / f"rank{rank}")
    assert detect_mode([tmp_path]) == "training"
    report = check_layout([tmp_path])
    assert report.mode == "training" and report.ok, _whats(report)
    assert report.dumps == 8
    assert report.counts["step_1/actor_update"]["ranks"] == ["rank0", "rank1"]


def test_training_layout_problems(tmp_path: Path) -> None:
    for g in (1, 2):
        for rank in (0, 1):
            write_dump(tmp_path / f"step_{g}" / "actor_update" / "step0" / f"rank{rank}")
    write_dump(tmp_path / "step_1" / "ref_compute_log_prob" / "step0" / "rank0")
    write_dump(tmp_path / "step_1" / "ref_compute_log_prob" / "step0" / "rank1", "")
    (tmp_path / "step_2" / "actor_update" / "step0" / "rank1" / "dump.json").unlink()
    problems = _whats(check_layout([tmp_path], "training"))
    assert any("step_2" in p and "missing stage(s) ref_compute_log_prob" in p for p in problems), problems
    assert any("step_2/actor_update/step0" in p and "missing rank1" in p for p in problems), problems
    assert any("ref_compute_log_prob/step0/rank1/dump.json: empty file" in p for p in problems), problems


def test_inference_layout_with_pid_level(tmp_path: Path) -> None:
    for step in (0, 1, 2, 4):
        for rank in (0, 1):
            write_dump(tmp_path / "4242" / f"step{step}" / f"rank{rank}")
    write_dump(tmp_path / "4242" / "step5" / "rank0", "{not json")
    write_dump(tmp_path / "4242" / "step6" / "rank0", {"task": "statistics", "data": {}})
    write_dump(tmp_path / "4242" / "step6" / "rank1")
    write_dump(tmp_path / "4242" / "step7" / "rank0")  # rank1 missing
    report = check_layout([tmp_path])
    assert report.mode == "inference"
    problems = _whats(report)
    assert any("missing steps step3 between step0 and step7" in p for p in problems), problems
    assert any("step5/rank0/dump.json: unparsable" in p for p in problems), problems
    assert any("step5: missing rank1" in p for p in problems), problems
    assert any("step6/rank0/dump.json: `data` is empty" in p for p in problems), problems
    assert any("step7: missing rank1" in p for p in problems), problems
    assert report.counts["pid 4242"]["dumps"] == 12


def test_consistency_layout(consistency_tree: tuple[Path, Path]) -> None:
    r, t = consistency_tree
    report = check_layout([r, t])
    assert report.mode == "consistency"
    assert len(report.logs["dispatch_log.jsonl"]) == 2 and len(report.logs["update_actor_log.jsonl"]) == 2
    assert "rollout: pid 100" in report.counts and "train: pid 300" in report.counts
    assert report.ok, _whats(report)


def test_consistency_without_training_log(consistency_tree: tuple[Path, Path], tmp_path: Path) -> None:
    r, _ = consistency_tree
    report = check_layout([r], "consistency")
    assert any("no update_actor_log.jsonl" in p for p in _whats(report))


def test_dump_index_accepts_every_layout(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "9" / "step1" / "rank3")
    b = write_dump(tmp_path / "step2" / "rank0")
    c = write_dump(tmp_path / "step3" / "proc9")
    d = write_dump(tmp_path / "9" / "step4" / "proc9")
    idx = DumpIndex(tmp_path)
    assert idx.find(9, 1, 3) == str(a)
    assert idx.find(9, 2, 0) == str(b)
    assert idx.find(9, 3, 0) == str(c)
    assert idx.find(9, 4, 0) == str(d)
    assert idx.find(9, 1, 0) is None
    assert idx.find(8, 4, 0) is None


def test_many_dumps_checked_in_processes(tmp_path: Path) -> None:
    for step in range(40):
        write_dump(tmp_path / f"step{step}" / "rank0", "" if step == 33 else None)
    serial, parallel = check_layout([tmp_path], jobs=1), check_layout([tmp_path], jobs=2)
    assert serial.problems == parallel.problems
    assert [p["where"] for p in parallel.problems] == [str(tmp_path / "step33" / "rank0" / "dump.json")]


def test_inference_folder_with_its_dispatch_log_is_inference(tmp_path: Path) -> None:
    # the vllm-dump patch writes dispatch_log.jsonl beside the rollout dumps in inference mode too
    for step in (0, 1):
        write_dump(tmp_path / "4242" / f"step{step}" / "rank0")
    (tmp_path / "4242" / "dispatch_log.jsonl").write_text('{"step": 0, "request_ids": ["a"]}\n')
    assert detect_mode([tmp_path]) == "inference"
    report = check_layout([tmp_path])
    assert report.mode == "inference" and report.ok, _whats(report)

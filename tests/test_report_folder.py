"""Report folders (`--out`): written only through files the command creates there, a user's file in
the way refused unless --force, a planted link replaced and never written through.

`mismatch report` on a small real triage log (the lines the verl-triage helper writes) is the
command; `ReportFolder` itself is checked for the race a link swapped in mid-run would exploit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rl_msprobe.errors import UserError
from rl_msprobe.report_folder import RECORD, ReportFolder
from tests.dumps.conftest import write_dump, write_jsonl
from tests.support.trees import run_cli


@pytest.fixture
def triage(tmp_path: Path) -> Path:
    folder = tmp_path / "triage"
    lines = [
        {
            "step": step,
            "request_id": f"r{step}{i}",
            "response_ids": [3, 4, 5],
            "rollout_log_probs": [-0.1, -0.2, -0.3],
            "train_log_probs": [-0.1, -0.2 - step / 10, -0.3],
        }
        for step in (1, 2, 3)
        for i in range(3)
    ]
    write_jsonl(folder / "7" / "triage.jsonl", lines)
    return folder


def report(folder: Path, out: Path, *extra: str) -> tuple[int, str]:
    code, _, err = run_cli("mismatch", "report", str(folder), "--out", str(out), *extra)
    return code, err


def test_a_users_report_in_the_way_is_refused_then_replaced_with_force(triage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    (out / "notes.txt").write_text("keep\n")
    code, err = report(triage, out)
    assert code == 2 and f"{out / 'report.md'}" in err and "--force" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.md"]  # nothing written
    assert (out / "report.md").read_text() == "my notes\n"
    code, err = report(triage, out, "--force")
    assert code in (0, 1), err
    assert "my notes" not in (out / "report.md").read_text() and (out / "notes.txt").read_text() == "keep\n"


def test_a_report_it_wrote_is_replaced_without_force_but_not_once_edited(triage, tmp_path):
    out = tmp_path / "out"
    assert report(triage, out)[0] in (0, 1)
    assert json.loads((out / RECORD).read_text())["files"]["summary.json"]
    assert report(triage, out)[0] in (0, 1)  # its own files: replaced
    (out / "summary.json").write_text("{}\n")
    code, err = report(triage, out)
    assert code == 2 and "summary.json" in err, err
    assert (out / "summary.json").read_text() == "{}\n"


@pytest.mark.parametrize("name", ["summary.json", "report.md", "report.html"])
def test_a_symlinked_report_file_is_never_written_through(triage, tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (out / name).symlink_to(victim)
    code, err = report(triage, out)
    assert code == 2 and name in err, err
    code, err = report(triage, out, "--force")
    assert code in (0, 1), err
    assert victim.read_text() == "precious\n"
    assert not (out / name).is_symlink()


def test_a_folder_everyone_may_write_is_refused(triage, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    code, err = report(triage, out)
    assert code == 2 and "every user" in err, err
    assert list(out.iterdir()) == []


def test_a_link_swapped_in_after_the_check_is_replaced_not_followed(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.write_text("precious\n")
    with ReportFolder(out) as folder:
        folder.write("summary.json", "{}\n")
        (out / "summary.json").symlink_to(victim)  # planted between the write and the commit
        with pytest.raises(UserError):
            folder.commit()
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]  # the link; no temporary left
    with ReportFolder(out, force=True) as folder:
        folder.write("summary.json", "{}\n")
    assert victim.read_text() == "precious\n" and (out / "summary.json").read_text() == "{}\n"


def test_a_failed_command_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError), ReportFolder(out) as folder:
        folder.write("report.md", "half\n")
        raise RuntimeError("the report failed half-way")
    assert list(out.iterdir()) == []


def test_dumps_compare_with_a_python_that_does_not_exist_is_bad_input(tmp_path):
    write_dump(tmp_path / "a" / "step0" / "rank0")
    write_dump(tmp_path / "b" / "step0" / "rank0")
    code, _, err = run_cli(
        "dumps", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"),
        "--python", "/nonexistent/python",
    )  # fmt: skip
    assert code == 2 and "/nonexistent/python" in err and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/nonexistent/python" in errors[0], err  # one plain line says why


def test_the_record_is_ours_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path / "elsewhere", out / RECORD)
    with ReportFolder(out) as folder:
        folder.write("a.txt", "x")
    assert not (tmp_path / "elsewhere").exists()  # a linked record is left alone, never followed


def test_dumps_compare_refuses_a_users_report_before_msprobe_runs(tmp_path):
    write_dump(tmp_path / "a" / "step0" / "rank0")
    write_dump(tmp_path / "b" / "step0" / "rank0")
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    code, _, err = run_cli("dumps", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out))
    assert code == 2 and str(out / "report.md") in err and "--force" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]  # nothing compared, nothing written


def test_the_compare_report_replaces_a_planted_link_never_writing_through(tmp_path):
    from rl_msprobe.dumps.compare import CompareRun
    from rl_msprobe.dumps.report import write_report

    out, victim = tmp_path / "o", tmp_path / "victim"
    out.mkdir()
    victim.write_text("precious\n")
    (out / "summary.json").symlink_to(victim)
    with pytest.raises(UserError, match="summary.json"):
        write_report(CompareRun(out=out, backend="fsdp"))
    paths = write_report(CompareRun(out=out, backend="fsdp"), force=True)
    assert victim.read_text() == "precious\n" and json.loads(paths["json"].read_text())

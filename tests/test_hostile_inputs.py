"""Issue 45's hostile inputs (tests/support/hostile.py), each through the real command line: the exit
code and the one line each must answer with, never a traceback, no user byte lost; and the readers the
FIFO and device cases reach, run in a process of their own, within 10 s and 1 GiB (GNU time's peak).

The one mock: a folder that cannot be listed is simulated (os.scandir raising EACCES, hostile.PRELUDE),
since these tests run as root, which lists every folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import hostile
from tests.support.trees import run_cli

LIMIT_S = 10.0
LIMIT_BYTES = 1 << 30


def _param(case: hostile.Case) -> object:
    marks = [pytest.mark.release] if case.needs == "release" else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in hostile.CASES])
def test_each_hostile_input_gets_its_exit_code_and_one_line(
    case: hostile.Case, tmp_path: Path, monkeypatch
) -> None:
    if case.needs == "torch":
        pytest.importorskip("torch")
    monkeypatch.setattr(os, "scandir", os.scandir)  # restored after the test; PRELUDE replaces it
    exec(hostile.PRELUDE, {})
    try:
        args = case.build(tmp_path)
        code, out, err = run_cli(*args)
    finally:
        if (tmp_path / "d").is_dir():  # 1,100 nested folders: Python's rmtree (pytest's cleanup) recurses
            subprocess.run(["rm", "-rf", str(tmp_path / "d")], check=True)
    line = hostile.first_line(out, err)
    assert "Traceback" not in err, err
    assert code == case.code, f"{case.name}: exit {code}: {line}"
    if code == 2:
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.words in out + err, f"{case.name}: {line}"
    if case.name == "ckpt-f8":  # an 8-bit float tensor is not compared, never "missing"
        assert "not-compared: model.norm.weight" in out and "missing" not in out, out
    if case.after is not None:
        case.after(tmp_path)


BOUNDED = [
    "ckpt-fifo-shard",
    "ckpt-zero-shard",
    "ckpt-zero-index",
    "ckpt-fifo-index",
    "check-fifo",
    "check-device",
]


@pytest.mark.parametrize("name", BOUNDED)
def test_the_readers_of_fifos_and_devices_are_bounded(name: str, tmp_path: Path) -> None:
    """Wall time, and the peak resident memory GNU time reports (hostile.measure)."""
    pytest.importorskip("torch")
    if not (os.path.exists("/usr/bin/time") and shutil.which("prlimit")):
        pytest.skip("GNU time (/usr/bin/time) and prlimit (util-linux) measure and cap the command")
    case = next(c for c in hostile.CASES if c.name == name)
    run = hostile.measure(case.build(tmp_path), Path(__file__).resolve().parents[1], limit_s=3 * LIMIT_S)
    assert run.code == case.code, (run.code, run.err[-2000:])
    assert run.seconds <= LIMIT_S and 0 < run.peak_rss <= LIMIT_BYTES, (run.seconds, run.peak_rss >> 20)


def test_the_size_of_1100_nested_folders_is_walked_without_recursion(tmp_path: Path) -> None:
    from rl_msprobe.dumps.whole_response import sizes

    hostile._nested(tmp_path)
    try:
        assert sizes(tmp_path, tmp_path / "train") == {
            "rollout": len(hostile.json.dumps(hostile.TRIAGE)) + 1,
            "train_records": 0,
        }
    finally:
        subprocess.run(["rm", "-rf", str(tmp_path / "d")], check=True)


def test_a_name_that_is_not_utf8_prints_under_a_strict_utf8_stdout(tmp_path: Path) -> None:
    """PYTHONIOENCODING=utf-8 makes stdout strict: the name is printed as its bytes, no traceback."""
    import sys

    folder = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff/step0/rank0")
    os.makedirs(folder)
    os.mkfifo(os.path.join(folder, "dump.json"))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    run = subprocess.run(
        [sys.executable, "-m", "rl_msprobe", "dumps", "check", str(tmp_path)],
        capture_output=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 1 and b"Traceback" not in run.stderr, run.stderr[-2000:]
    assert b"/\xff/step0/rank0/dump.json: is a named pipe (FIFO)" in run.stdout, run.stdout


@pytest.mark.release
def test_a_plain_tree_helper_is_replaced_only_when_it_holds_what_rl_msprobe_wrote(tmp_path: Path) -> None:
    """Outside git the manifest's hash of what rl-msprobe wrote decides: the user's edit is refused,
    the same bytes recorded as rl-msprobe's (an older rl-msprobe's helper) are replaced."""
    import hashlib
    import json

    tree = hostile._tree(tmp_path, with_git=False)
    helper = tree / hostile.HELPER
    ours = helper.read_bytes()
    edited = ours + b"# the user's edit\n"
    helper.write_bytes(edited)
    code, _, err = run_cli("patch", "apply", "verl-triage", "--tree", str(tree))
    assert code == 2 and "apply would replace your edits" in err and helper.read_bytes() == edited, err
    manifest = tree / ".rl-msprobe" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"][hostile.HELPER]["applied_sha256"] = hashlib.sha256(edited).hexdigest()
    manifest.write_text(json.dumps(doc))
    code, _, err = run_cli("patch", "apply", "verl-triage", "--tree", str(tree))
    assert code == 0 and helper.read_bytes() == ours, err

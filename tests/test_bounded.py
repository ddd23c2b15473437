"""Every read is bounded: FIFOs, devices and oversized files are refused by type and size before they
are read, expansions and numbers a script or log could blow up are capped, with the limit named.

Cases that used to hang or eat memory run as a real `rl-msprobe` process under a wall-clock timeout
and an address-space limit (RLIMIT_AS), so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_msprobe import bounded
from rl_msprobe.errors import UserError
from tests.dumps.conftest import dispatch, update, write_dump, write_jsonl
from tests.support.trees import run_cli

ROOT = Path(__file__).resolve().parents[1]
MEMORY = 3 << 30  # address space for one run (the interpreter with numpy mapped is ~1 GiB)
COMMAND = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm"


def cli(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    """`rl-msprobe ARGS` as its own process under a memory limit; (exit code, stderr, seconds)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rl_msprobe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


# ---------------------------------------------------------------- launch scripts


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero"])
@pytest.mark.parametrize("command", ["detect", "check", "prepare"])
def test_a_launch_script_that_is_not_a_file_is_refused_at_once(tmp_path, make, command):
    script = make(tmp_path / "run.sh")
    args = [command, str(script)] + (["--mode", "training"] if command != "detect" else [])
    code, err, _ = cli(*args)
    assert code == 2 and str(script) in err and "not a regular file" in err, err
    assert "Traceback" not in err


def test_a_launch_script_over_the_limit_is_refused_naming_it_quickly(tmp_path):
    script = tmp_path / "run.sh"
    args = " ".join(f"a.b{i}=v{i}" for i in range(1_100_000))  # a 20 MB command
    script.write_text(f"{COMMAND} {args}\n")
    code, err, seconds = cli("detect", str(script))
    assert code == 2 and "4 MiB" in err and str(script) in err, err
    assert seconds < 20


def test_a_long_command_under_the_limit_is_read_in_linear_time(tmp_path):
    script = tmp_path / "run.sh"
    args = " ".join(f"a.b{i}=v{i}" for i in range(150_000))  # 2.6 MB, 150k Hydra overrides
    script.write_text(f"{COMMAND} {args}\n")
    code, err, seconds = cli("detect", str(script), "--json", timeout=120)
    assert code in (0, 1) and "Traceback" not in err, err
    assert seconds < 60  # Hydra's parser for each override took ~3 minutes here


@pytest.mark.parametrize(
    "body",
    [
        ["A=(x y)", *['A=("${A[@]}" "${A[@]}")'] * 40, f"{COMMAND} data.n=${{#A[@]}}"],
        ["S=xy", *['S="$S$S"'] * 40, f"{COMMAND} data.s=$S"],
        ["S=$1", *['S="$S$S"'] * 40, f"{COMMAND} data.s=$S"],
        ["N=3", *["N=$((N*N))"] * 30, f"{COMMAND} data.n=$N"],
        ["A=(x)", *['A+=("${A[@]}")'] * 40, f'{COMMAND} data.a="${{A[*]}}"'],
    ],
    ids=["array-doubled", "string-doubled", "runtime-doubled", "squared", "array-appended"],
)
def test_expansions_that_double_are_capped_in_size(tmp_path, body):
    script = tmp_path / "run.sh"
    script.write_text("\n".join(body) + "\n")
    code, err, seconds = cli("detect", str(script), "--json")
    assert code in (0, 1) and "Traceback" not in err and "MemoryError" not in err, err
    assert seconds < 30


def test_invalid_utf8_script_names_the_line(tmp_path):
    script = tmp_path / "run.sh"
    script.write_bytes(b"#!/bin/bash\n" + COMMAND.encode() + b" data.x=\xff\n")
    code, _, err = run_cli("detect", str(script))
    assert code == 2 and f"{script}:2: not UTF-8" in err, err


# ---------------------------------------------------------------- logs and dumps


def _triage_folder(tmp_path: Path, line: dict | None = None) -> Path:
    folder = tmp_path / "triage"
    good = {
        "step": 1,
        "request_id": "r",
        "response_ids": [3, 4],
        "rollout_log_probs": [-0.1, -0.2],
        "train_log_probs": [-0.1, -0.3],
    }
    write_jsonl(folder / "1" / "triage.jsonl", [good] + ([line] if line else []))
    return folder


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero"])
def test_a_triage_log_that_is_not_a_file_is_refused(tmp_path, make):
    folder = tmp_path / "triage"
    (folder / "1").mkdir(parents=True)
    make(folder / "1" / "triage.jsonl")
    code, err, _ = cli("mismatch", "report", str(folder))
    assert code == 2 and "triage.jsonl: is a" in err and "not a regular file" in err, err


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero"])
def test_a_dispatch_log_that_is_not_a_file_is_refused(tmp_path, make):
    r, t = tmp_path / "gen", tmp_path / "actor"
    (r / "100").mkdir(parents=True)
    make(r / "100" / "dispatch_log.jsonl")
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "aaaa")])
    code, err, _ = cli("dumps", "correlate", str(r), str(t))
    assert code == 2 and "dispatch_log.jsonl: is a" in err, err


def test_a_dump_json_that_is_a_device_is_a_problem_not_a_hang(tmp_path):
    write_dump(tmp_path / "step0" / "rank0")
    (tmp_path / "step1" / "rank0").mkdir(parents=True)
    _zero(tmp_path / "step1" / "rank0" / "dump.json")
    code, err, _ = cli("dumps", "check", str(tmp_path), "--mode", "inference")
    assert code == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("id_", [300_000_000, 2**40, int("9" * 30)], ids=["3e8", "2^40", "30-digit"])
def test_token_ids_beyond_any_vocabulary_are_left_out_with_the_limit_named(tmp_path, id_):
    line = {
        "step": 2,
        "response_ids": [id_, 4],
        "rollout_log_probs": [-0.1, -0.2],
        "train_log_probs": [-1, -2],
    }
    folder = _triage_folder(tmp_path, line)
    code, out, err = run_cli("mismatch", "report", str(folder), "--json")
    assert code in (0, 1), err
    doc = json.loads(out)
    assert doc["bad_lines"] == 1 and {s["step"] for s in doc["steps"]} == {1, 2}
    report = (folder / "report" / "report.md").read_text()
    assert "16,777,216" in report  # the limit, named where the reader says what it left out


def test_a_stray_step_folder_is_refused_by_name_without_allocating_the_gap(tmp_path):
    write_dump(tmp_path / "step0" / "rank0")
    write_dump(tmp_path / "step999999999999" / "rank0")
    code, err, seconds = cli("dumps", "check", str(tmp_path), "--mode", "inference")
    assert code == 2 and "step999999999999" in err and "10,000,000" in err, err
    assert seconds < 20


def test_missing_steps_are_named_from_the_steps_present():
    from rl_msprobe.dumps.layout import step_gaps

    assert step_gaps([0, 1, 3, 9_000_000]) == "step2, step4-8999999"
    assert step_gaps([4]) == ""


def test_a_line_without_end_is_refused_at_the_line_limit(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"x" * 5000)
    with bounded.open_regular(path, "log") as handle, pytest.raises(UserError) as info:
        list(bounded.lines(handle, path, "log", limit=1000))
    assert f"{path}:2: a line longer than 1,000 bytes" in str(info.value)


def test_read_bytes_refuses_a_file_over_its_limit_and_reads_one_under(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert bounded.read_bytes(path, "thing", 100) == b"x" * 100
    with pytest.raises(UserError, match="100 bytes, more than the 99 bytes a thing may have"):
        bounded.read_bytes(path, "thing", 99)


@pytest.mark.parametrize(
    "doc",
    ['{"data": {"x": ' + "9" * 5000 + "}}", "[" * 100_000, '{"data": {"x": Infinity}}'],
    ids=["5000-digits", "nested", "infinity"],
)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_hostile_dump_json_is_a_problem_in_the_pool_too(tmp_path, doc, jobs):
    for step in range(40):  # 32 or more files go to the --jobs pool
        write_dump(tmp_path / f"step{step}" / "rank0")
    write_dump(tmp_path / "step40" / "rank0", doc)
    code, out, err = run_cli("dumps", "check", str(tmp_path), "--mode", "inference", "--jobs", jobs, "--json")
    assert code in (0, 1) and "Traceback" not in err, err


def test_infinite_tokens_in_a_dispatch_log_are_a_skipped_line(tmp_path):
    r, t = tmp_path / "gen", tmp_path / "actor"
    line = dispatch(100, 0, 0, "prefill", ("aaaa-0123abcd", "cached", 7))
    text = json.dumps(line).replace('"tokens": 7', '"tokens": Infinity')
    write_jsonl(r / "100" / "dispatch_log.jsonl", [text])
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "aaaa")])
    write_dump(r / "100" / "step0" / "rank0")
    write_dump(t / "300" / "step0" / "rank0")
    code, _, err = run_cli("dumps", "correlate", str(r), str(t))
    assert code in (0, 1, 2) and "Traceback" not in err, err

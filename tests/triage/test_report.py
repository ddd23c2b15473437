"""`rl-msprobe mismatch report`: the streamed sums against a direct computation, bad input, the
jump and the proposed consistency dump, the files it writes, and --json."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_msprobe.triage import stream
from rl_msprobe.triage.stream import read_triage
from tests.support.added_files import load
from tests.support.trees import run_cli

SCRIPT = """#!/bin/bash
python3 -m verl.trainer.main_ppo \\
    data.train_files=/data/train.parquet \\
    data.val_files=/data/val.parquet \\
    actor_rollout_ref.rollout.name=vllm \\
    trainer.total_training_steps=100 $@
"""


def helper_module():
    """The helper the verl-triage set adds, as a module (it writes the lines a real job writes)."""
    return load("verl/verl/utils/rl_msprobe_triage.py", "rl_msprobe_triage_for_report")


def as_written(line: dict, fmt: str) -> str:
    """One line as json.dumps writes it, or as the helper does (its key order: the arrays last)."""
    if fmt == "json":
        return json.dumps(line)
    helper = helper_module()
    arrays = ("prompt_ids", "response_ids", "rollout_log_probs", "train_log_probs")
    ordered = {k: v for k, v in line.items() if k not in arrays}
    for key in arrays:
        if key in line:
            ordered[key] = helper._Floats(line[key]) if key.endswith("log_probs") else line[key]
    return helper._dumps(ordered)


def write_log(
    folder: Path,
    steps: int = 5,
    per_step: int = 30,
    jump_at: int | None = 4,
    seed: int = 0,
    fmt: str = "json",
    ids: str = "s{step}r{i}",
) -> list[dict]:
    rnd = random.Random(seed)
    lines = []
    for step in range(1, steps + 1):
        for i in range(per_step):
            n = rnd.randint(1, 40)
            rollout = [-rnd.expovariate(1.0) for _ in range(n)]
            scale = 0.05 if jump_at and step >= jump_at else 0.005
            train = [r + rnd.gauss(0, scale) for r in rollout]
            line = {
                "schema": "rl-msprobe-triage/1",
                "step": step,
                "index": i,
                "request_id": ids.format(step=step, i=i),
                "uid": f"u{i // 2}",
                "prompt_len": 3,
                "prompt_ids": [1, 2, 3],
                "response_ids": [rnd.randrange(50) for _ in range(n)],
                "rollout_log_probs": [float(f"{np.float32(v):.9g}") for v in rollout],
                "train_log_probs": [float(f"{np.float32(v):.9g}") for v in train],
                "sample": {"data_source": "d", "prompt": [{"role": "user", "content": f"q{i}"}]},
            }
            if i % 7 == 3 and n > 2:
                line["mask"] = [1] * (n - 2) + [0, 1]
            lines.append(line)
    (folder / "123").mkdir(parents=True)
    (folder / "123" / "triage.jsonl").write_text("".join(as_written(x, fmt) + "\n" for x in lines))
    return lines


def direct(lines: list[dict], step: int) -> dict[str, np.ndarray]:
    """verl's definition by hand: float32 exp, verl's mask, one token list per step."""
    rs = [x for x in lines if x["step"] == step]
    r = np.concatenate([np.float32(x["rollout_log_probs"]) for x in rs])
    t = np.concatenate([np.float32(x["train_log_probs"]) for x in rs])
    m = np.concatenate([np.array(x.get("mask", [1] * len(x["rollout_log_probs"])), bool) for x in rs])
    return {
        "dp": np.abs(np.exp(t) - np.exp(r)).astype(np.float64)[m],
        "dlogp": np.abs(t.astype(float) - r)[m],
    }


@pytest.mark.parametrize("fmt", ["json", "helper"])  # json reads the first, numpy the arrays of the second
@pytest.mark.parametrize("chunk", [7, stream.CHUNK])  # many flushes, and one
def test_per_step_numbers_equal_a_direct_computation(tmp_path, monkeypatch, chunk, fmt):
    monkeypatch.setattr(stream, "CHUNK", chunk)
    lines = write_log(tmp_path, fmt=fmt)
    result = read_triage(tmp_path)
    assert result.requests == len(lines) and result.bad_count == 0
    for stats in result.step_list():
        want = direct(lines, stats.step)
        for q in ("dp", "dlogp"):
            gap = stats.gaps[q]
            assert gap.count == len(want[q])
            # the direct way subtracts in float32, the report in float64: float32 precision apart
            assert gap.mean() == pytest.approx(want[q].mean(), rel=1e-5)
            assert gap.peak == pytest.approx(want[q].max(), rel=1e-5)
            assert gap.std() == pytest.approx(want[q].std(ddof=1), rel=1e-5)
            p99 = gap.quantile(0.99)
            exact = np.quantile(want[q], 0.99, method="inverted_cdf")
            assert exact * (1 - 1e-9) <= p99 <= max(exact * 1.016, 1e-9)  # histogram: within one bin above


def test_positions_tokens_and_worst_requests(tmp_path):
    lines = write_log(tmp_path, jump_at=None)
    k = next(i for i, x in enumerate(lines) if len(x["rollout_log_probs"]) > 3 and "mask" not in x)
    lines[k]["rollout_log_probs"][2] -= 3.0  # one planted token: the worst request, at position 2
    (tmp_path / "123" / "triage.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = read_triage(tmp_path, keep=3)
    worst = result.worst[0]
    assert worst.request_id == lines[k]["request_id"] and worst.positions[0]["position"] == 2
    assert worst.positions[0]["token_id"] == lines[k]["response_ids"][2]
    assert len(result.worst) == 3 and result.worst[0].key >= result.worst[1].key >= result.worst[2].key
    sums, counts = result.by_position["dlogp"]
    assert counts.sum() == result.overall["dlogp"].count
    assert counts[0] == len(lines)  # every response has a position 0
    tsums, tcounts = result.by_token["dp"]
    assert tcounts.sum() == result.overall["dp"].count


def test_bad_and_error_lines_are_counted_and_named(tmp_path):
    write_log(tmp_path, steps=2, per_step=3)
    with open(tmp_path / "123" / "triage.jsonl", "a") as f:
        f.write('{"schema": "rl-msprobe-triage/1", "step": 2, "error": "KeyError: old_log_probs"}\n')
        f.write("not json\n")
        f.write('{"step": 2, "rollout_log_probs": [1.0], "train_log_probs": []}\n')
        f.write('{"step": 2, "rollout_log_probs": [-1.0, null], "train_log_probs": [-1.0, -2.0]}\n')
        f.write("\n")
    result = read_triage(tmp_path)
    assert result.error_count == 1 and "old_log_probs" in result.errors[0]
    assert result.bad_count == 2 and ":8:" in result.bad_lines[0] or ":8:" in " ".join(result.bad_lines)
    assert result.nonfinite == 1 and result.requests == 7


def test_a_folder_without_logs_is_exit_2(tmp_path):
    code, _, err = run_cli("mismatch", "report", str(tmp_path))
    assert code == 2 and "triage.jsonl" in err and "--mode triage" in err


def proposal_of(tmp_path: Path, *args: str, script_text: str = SCRIPT) -> dict:
    """`mismatch report` of the standard log (jump at step 4) with --script and ARGS: its proposal."""
    folder = tmp_path / "triage"
    if not folder.exists():
        write_log(folder)
    script = tmp_path / "run_job.sh"
    script.write_text(script_text)
    code, out, err = run_cli("mismatch", "report", str(folder), "--script", str(script), *args, "--json")
    assert code == 0, err
    return json.loads(out)["proposal"]


def test_the_proposed_command_names_the_interpreter_or_asks_for_it(tmp_path):
    """A consistency dump patches verl and the rollout engine and compares with msprobe in the
    training interpreter: the command names it (--python) when known, else a placeholder."""
    proposal = proposal_of(tmp_path, "--python", "/v/bin/python")
    assert proposal["commands"] == [
        f"rl-msprobe prepare {proposal['script']} --mode consistency --batch-one --python /v/bin/python"
    ]
    unknown = proposal_of(tmp_path)
    assert unknown["commands"][0].endswith("--mode consistency --batch-one")  # pastes and runs in bash
    assert any("add --python PY" in n for n in unknown["notes"])
    # the interpreter `prepare --python` recorded above the folder (rl_msprobe.dumps.compare.PYTHON_RECORD)
    (tmp_path / "rl-msprobe-python.json").write_text(json.dumps({"python": "/rec/python3"}))
    assert proposal_of(tmp_path)["commands"][0].endswith(
        "--mode consistency --batch-one --python /rec/python3"
    )


def test_a_stable_request_id_is_proposed_on_the_job_itself(tmp_path):
    """Ids a rerun sends again (rl_msprobe_consistency.stable_request_id): the first command records
    only the worst request at its step on the job's own script (its batch and parallelism kept); the
    one-prompt reproduction stays as the second. verl's fresh uuids: only the one-prompt one."""
    write_log(tmp_path / "triage", ids="rlm{step:08d}{i:08x}n0")
    proposal = proposal_of(tmp_path, "--python", "/v/bin/python")
    worst = proposal["request"]["request_id"]
    assert worst.startswith("rlm") and len(proposal["commands"]) == 2
    assert proposal["commands"][0] == (
        f"rl-msprobe prepare {tmp_path / 'run_job.sh'} --mode consistency --steps 4 --request {worst} "
        "--python /v/bin/python"
    )
    assert "--batch-one" in proposal["commands"][1]
    pasted = proposal_of(tmp_path)["commands"][0]  # no interpreter known: it pastes and runs as it is
    code, out, err = run_cli(*pasted.split()[1:], "--json")
    assert code == 0 and json.loads(out)["written"] is True, err


def test_report_files_jump_and_proposal(tmp_path):
    folder = tmp_path / "triage"
    write_log(folder)
    script = tmp_path / "run_job.sh"
    script.write_text(SCRIPT)
    code, out, err = run_cli(
        "mismatch", "report", str(folder), "--script", str(script), "--tree", "/opt/verl", "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["growth"]["jump_step"] == 4 and doc["proposal"]["step"] == 4
    proposal = doc["proposal"]
    assert proposal["request"]["step"] == 4
    assert proposal["commands"] == [
        f"rl-msprobe prepare {proposal['script']} --mode consistency --batch-one --tree /opt/verl"
    ]
    row = json.loads(Path(proposal["data_file"]).read_text())
    assert row["prompt"][0]["role"] == "user" and row["data_source"] == "d"
    # step 4 sampled with weights trained for 3 steps; the script saved none: say so and how
    trained = [n for n in proposal["notes"] if "trained for 3 step(s)" in n]
    assert trained and "saved no checkpoint at step 3 (trainer.save_freq=-1, verl's default)" in trained[0]
    assert "global_step_3/actor/huggingface" in trained[0]
    derived = Path(proposal["script"]).read_text()
    assert (
        f"data.train_files={proposal['data_file']}" in derived
        and f"data.val_files={proposal['data_file']}" in derived
    )
    assert (
        "trainer.total_training_steps=1" in derived and script.read_text() == SCRIPT
    )  # the original untouched
    out_dir = folder / "report"
    for name in ("report.md", "report.html", "summary.json", "gap_per_step.png", "gap_by_position.png"):
        assert (out_dir / name).is_file(), name
    md = (out_dir / "report.md").read_text()
    assert "jumps at step 4" in md and "rl-msprobe prepare" in md and "| step | requests |" in md
    assert "data:image/png;base64," in (out_dir / "report.html").read_text()
    # the proposed script is what `prepare --mode consistency` takes
    code, out, err = run_cli("prepare", proposal["script"], "--mode", "consistency", "--batch-one", "--json")
    assert json.loads(out)["written"] is True, err


def test_without_matplotlib_the_report_says_so(tmp_path, monkeypatch):
    write_log(tmp_path, steps=2, per_step=3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, out, err = run_cli("mismatch", "report", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 0 and any("matplotlib is not installed" in n for n in doc["notes"])
    assert not list((tmp_path / "report").glob("*.png")) and (tmp_path / "report" / "report.md").is_file()


def test_flat_gap_proposes_the_largest_step_without_script(tmp_path):
    write_log(tmp_path, steps=3, jump_at=None)
    code, out, _ = run_cli("mismatch", "report", str(tmp_path), "--json")
    doc = json.loads(out)
    means = {s["step"]: s["dp"]["mean"] for s in doc["steps"]}
    assert doc["growth"]["jump_step"] is None
    assert doc["proposal"]["step"] == max(means, key=means.get)
    assert doc["proposal"]["commands"][0] == 'rl-msprobe prepare "$SCRIPT" --mode consistency --batch-one'
    assert any(n.startswith("set SCRIPT to your launch script") for n in doc["proposal"]["notes"])
    assert all(math.isfinite(s["dlogp"]["p99"]) for s in doc["steps"])


def test_numeric_request_ids_name_the_data_file(tmp_path):
    """check_head lets a number through as a request id; the proposal's file name is made of
    its text (it used to slice the number: TypeError, a traceback)."""
    log = tmp_path / "123" / "triage.jsonl"
    lines = write_log(tmp_path, steps=2, per_step=4)
    log.write_text(
        "".join(json.dumps({**x, "request_id": 1000 + x["index"], "uid": None}) + "\n" for x in lines)
    )
    code, out, err = run_cli("mismatch", "report", str(tmp_path), "--json")
    assert code == 0, err
    proposal = json.loads(out)["proposal"]
    assert (
        Path(proposal["data_file"]).name
        == f"repro_step{proposal['step']}_{proposal['request']['request_id']}.jsonl"
    )
    assert isinstance(proposal["request"]["request_id"], int)


def test_a_checkpoint_the_triage_run_saved_is_named(tmp_path):
    notes = proposal_of(tmp_path, script_text=SCRIPT.replace("$@", "trainer.save_freq=3 $@"))["notes"]
    assert any("saved a checkpoint at step 3 (trainer.save_freq=3)" in n for n in notes), notes


def summary(result, folder: Path) -> dict:
    """Everything a report is made of, comparable across two reads (the folder's name left out)."""
    doc = {
        "lines": result.lines,
        "requests": result.requests,
        "bad": (result.bad_count, result.bad_lines),
        "errors": result.error_count,
        "nonfinite": result.nonfinite,
        "steps": [s.to_json() for s in result.step_list()],
        "worst": [w.to_json(full=True) for w in result.worst],
        "by_position": {q: [a.tolist() for a in v] for q, v in result.by_position.items()},
        "by_token": {q: [a.tolist() for a in v] for q, v in result.by_token.items()},
    }
    return json.loads(json.dumps(doc).replace(str(folder), "FOLDER"))


# Lines that look like the helper's but are not what they seem: read as json reads them.
TRICKY = [
    # the tail's key text inside a string value: the quote in what follows sends it to json
    '{"step": 1, "note": ", \\"response_ids\\": [1], \\"rollout_log_probs\\": [2], \\"train_log_probs\\": [3]}", '
    '"response_ids": [7], "rollout_log_probs": [-1.5], "train_log_probs": [-1.25]}',
    # the arrays nested in another object: the head does not parse as an object
    '{"step": 1, "x": {"a": 1, "response_ids": [1], "rollout_log_probs": [-1], "train_log_probs": [-2]}}',
    # a number numpy would read that json refuses, and one neither reads: bad lines, as before
    '{"step": 1, "response_ids": [1, 2], "rollout_log_probs": [-1.5, 1..2], "train_log_probs": [-1, -2]}',
    '{"step": 1, "response_ids": [1], "rollout_log_probs": [-1,,], "train_log_probs": [-1]}',
    # a null (a non-finite log-prob): json reads it, the token is left out
    '{"step": 2, "response_ids": [4, 5], "rollout_log_probs": [null, -0.5], "train_log_probs": [-0.25, -0.75]}',
    # empty arrays (nothing verl's mask counts), unequal arrays, tokens of another length
    '{"step": 2, "response_ids": [], "rollout_log_probs": [], "train_log_probs": []}',
    '{"step": 2, "response_ids": [1, 2], "rollout_log_probs": [-1.0, -2.0], "train_log_probs": [-1.0]}',
    '{"step": 2, "response_ids": [9], "rollout_log_probs": [-1.0, -2.0], "train_log_probs": [-1.5, -2.5]}',
    # trailing spaces and a CRLF ending, and an error line
    '{"step": 3, "response_ids": [3], "rollout_log_probs": [-3.0], "train_log_probs": [-3.5]}   \r',
    '{"schema": "rl-msprobe-triage/1", "step": 3, "error": "KeyError: old_log_probs"}',
]


@pytest.mark.parametrize("chunk", [3, stream.CHUNK])
def test_numpy_read_arrays_give_what_json_gives(tmp_path, monkeypatch, chunk):
    """The helper's lines (arrays last, read by numpy) and the same lines in json.dumps order
    (read whole by json) make the same report, tricky lines mixed in."""
    monkeypatch.setattr(stream, "CHUNK", chunk)
    results = {}
    for fmt in ("json", "helper"):
        folder = tmp_path / fmt
        write_log(folder, steps=3, per_step=20, fmt=fmt)
        with open(folder / "123" / "triage.jsonl", "a") as f:
            f.write("".join(line + "\n" for line in TRICKY))
        results[fmt] = summary(read_triage(folder, keep=5), folder)
    assert results["helper"] == results["json"]
    fast = sum(1 for x in TRICKY if stream.split_tail(x.encode()) is not None)
    assert 0 < fast < len(TRICKY)  # some tricky lines take the numpy path, the rest are refused by it
    got = results["helper"]
    # bad: the nested arrays (no log-probs of its own), 1..2, -1,, and the unequal arrays
    assert got["errors"] == 1 and got["bad"][0] == 4 and got["nonfinite"] == 1, got["bad"]


def test_the_helpers_own_lines_take_the_numpy_path(tmp_path, monkeypatch):
    """What verl-triage writes on a real batch ends with the three arrays the report reads with numpy."""
    helper = helper_module()
    from tests.patches.files.test_verl_triage import batch

    monkeypatch.setenv("RL_MSPROBE_TRIAGE", str(tmp_path))
    helper.log_requests(batch(), type("T", (), {"global_steps": 1})())
    (log,) = tmp_path.glob("*/triage.jsonl")
    raws = log.read_bytes().splitlines(keepends=True)
    assert len(raws) == 2 and all(stream.split_tail(raw) is not None for raw in raws)
    result = read_triage(tmp_path)
    assert result.requests == 2 and result.bad_count == 0

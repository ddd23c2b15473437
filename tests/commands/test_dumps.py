"""`rl-msprobe dumps ...`: exit codes, --json documents, plain messages for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.errors import UserError
from tests.dumps.conftest import dispatch, write_dump, write_jsonl


def _run(*args: str):
    return CliRunner().invoke(main, ["dumps", *args])


def test_check_exit_codes(tmp_path: Path) -> None:
    write_dump(tmp_path / "step0" / "rank0")
    write_dump(tmp_path / "step0" / "rank1")
    ok = _run("check", str(tmp_path), "--json")
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.output)
    assert doc["ok"] and doc["mode"] == "inference" and doc["dumps"] == 2
    write_dump(tmp_path / "step1" / "rank0")
    bad = _run("check", str(tmp_path))
    assert bad.exit_code == 1
    assert "step1: missing rank1" in bad.output and "1 problem(s) found" in bad.output
    missing = _run("check", str(tmp_path / "nope"))
    assert missing.exit_code == 2


def test_correlate_json(consistency_tree: tuple[Path, Path]) -> None:
    r, t = consistency_tree
    res = _run("correlate", str(r), str(t), "--json")
    doc = json.loads(res.output)
    assert sorted(p["request_id"] for p in doc["pairs"]) == ["aaaa", "ffff"]
    assert set(doc["pairs"][0]) == {"request_id", "rollout", "train", "tp_ranks"}
    assert set(doc["pairs"][0]["rollout"]) == {"pid", "rank", "step", "dump"}
    assert {"request_id": "zzzz", "side": "train", "why": "no rollout prefill step with this id"} in doc[
        "unmatched"
    ]
    assert res.exit_code == 1  # a dump is missing and a log line is cut short: problems found


def test_correlate_clean_exit_zero(tmp_path: Path) -> None:
    from tests.dumps.conftest import dispatch, update, write_jsonl

    write_jsonl(
        tmp_path / "g" / "1" / "dispatch_log.jsonl", [dispatch(1, 0, 0, "prefill", ("a-0000beef", "new", 3))]
    )
    write_dump(tmp_path / "g" / "1" / "step0" / "rank0")
    write_jsonl(tmp_path / "t" / "2" / "update_actor_log.jsonl", [update(2, 0, 0, "a")])
    write_dump(tmp_path / "t" / "2" / "step0" / "rank0")
    res = _run("correlate", str(tmp_path / "g"), str(tmp_path / "t"))
    assert res.exit_code == 0, res.output
    assert "pair a: rollout pid 1 step0 rank0  <->  train pid 2 step0 rank0" in res.output


def test_compare_bad_input_exits_2(tmp_path: Path, consistency_tree: tuple[Path, Path]) -> None:
    r, t = consistency_tree
    res = _run("compare", str(r), str(t), "--out", str(tmp_path / "with space"))
    assert res.exit_code == 2 and "without spaces" in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run("compare", str(empty), str(t), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "no dump.json found" in res.output


def test_compare_logs_without_pairs_exits_2(tmp_path: Path) -> None:
    from tests.dumps.conftest import dispatch, update, write_jsonl

    write_jsonl(
        tmp_path / "g" / "1" / "dispatch_log.jsonl", [dispatch(1, 0, 0, "decode", ("a", "cached", 1))]
    )
    write_jsonl(tmp_path / "t" / "2" / "update_actor_log.jsonl", [update(2, 0, 0, "a")])
    res = _run("compare", str(tmp_path / "g"), str(tmp_path / "t"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "dumps correlate" in res.output


def test_dumps_help_stays_light() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from rl_msprobe.cli import main;"
        "r = CliRunner().invoke(main, ['dumps', 'compare', '--help']); assert r.exit_code == 0, r.output;"
        "heavy = [m for m in ('matplotlib', 'msprobe', 'pandas', 'torch', 'rl_msprobe.dumps.report') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_compare_without_msprobe_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    import rl_msprobe.dumps.runners as runners

    monkeypatch.setattr(runners.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(runners.shutil, "which", lambda name: None)
    a, b = write_dump(tmp_path / "a" / "step0" / "rank0"), write_dump(tmp_path / "b" / "step0" / "rank0")
    res = _run("compare", str(a.parent), str(b.parent), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "pip install mindstudio-probe" in res.output and "--python" in res.output


def test_check_vllm_dump_inference_folder_is_inference(tmp_path: Path) -> None:
    """`vllm-dump` writes a dispatch log beside its inference dumps: that alone is no consistency run."""
    write_dump(tmp_path / "4242" / "step0" / "rank0")
    write_jsonl(tmp_path / "4242" / "dispatch_log.jsonl", [dispatch(4242, 0, 0, "prefill", ("a", "new", 3))])
    res = _run("check", str(tmp_path), "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 0 and doc["mode"] == "inference", doc


def test_compare_leaves_a_pairs_folder_it_did_not_create(tmp_path: Path) -> None:
    a, b = write_dump(tmp_path / "a" / "step0" / "rank0"), write_dump(tmp_path / "b" / "step0" / "rank0")
    out = tmp_path / "o"
    mine = out / "pairs" / "001_step0_rank0"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("user's")
    res = _run("compare", str(a.parent), str(b.parent), "--out", str(out))
    assert res.exit_code == 2 and "not created by rl-msprobe" in res.output
    assert (mine / "notes.txt").read_text() == "user's"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    out2 = tmp_path / "o2"
    out2.mkdir()
    (out2 / "pairs").symlink_to(elsewhere)
    res = _run("compare", str(a.parent), str(b.parent), "--out", str(out2))
    assert res.exit_code == 2 and (elsewhere / "keep").read_text() == "x"


def test_pairs_folder_of_an_earlier_run_is_renewed(tmp_path: Path) -> None:
    from rl_msprobe.dumps.compare import MARKER, pairs_dir, publish_pairs

    staging = pairs_dir(tmp_path)  # built beside <out>/pairs, put in place as a unit at the end
    (staging / "001_x").mkdir()
    (staging / "worker0.log").write_text("")
    publish_pairs(staging, tmp_path, [])
    pairs = tmp_path / "pairs"
    assert sorted(p.name for p in pairs.iterdir()) == [MARKER, "001_x", "worker0.log"]
    staging = pairs_dir(tmp_path)
    assert sorted(p.name for p in staging.iterdir()) == [MARKER] and (pairs / "001_x").is_dir()
    publish_pairs(staging, tmp_path, [])
    assert sorted(p.name for p in pairs.iterdir()) == [MARKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs"]  # nothing left beside it
    (pairs / "mine.txt").write_text("user's")
    with pytest.raises(UserError, match="not written by rl-msprobe"):
        pairs_dir(tmp_path)
    assert (pairs / "mine.txt").exists()


@pytest.mark.e2e
def test_compare_worker_survives_a_failing_pair(tmp_path: Path) -> None:
    """A pair msprobe fails on is reported with msprobe's own last lines; the worker goes on."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    from rl_msprobe.dumps.runners import WorkerRunner, interpreter

    runner = WorkerRunner(interpreter(None), tmp_path / "worker0.log")
    try:
        bad = runner.run(
            ["compare", "-tp", "/nonexistent/dump.json", "-gp", "/nonexistent/dump.json"],
            tmp_path / "1.log",
            300,
        )
        assert bad != 0
        proc = runner.proc
        again = runner.run(["compare", "--help"], tmp_path / "2.log", 300)
        assert again == 0 and runner.proc is proc  # the same process, msprobe imported once
        assert "--consistent_check" in (tmp_path / "2.log").read_text()
    finally:
        runner.close()


def test_compare_python_without_msprobe_says_so_per_pair(tmp_path: Path) -> None:
    """`--python PY` whose PY cannot import msprobe (here: site-packages off): every pair fails
    with that reason on the terminal, and the verdict is NOT COMPARED, never CONSISTENT."""
    a, b = write_dump(tmp_path / "a" / "step0" / "rank0"), write_dump(tmp_path / "b" / "step0" / "rank0")
    res = _run(
        "compare",
        str(a.parent),
        str(b.parent),
        "--out",
        str(tmp_path / "o"),
        "--python",
        f"{sys.executable} -S",
    )
    assert res.exit_code == 1, res.output
    assert "msprobe does not import in" in res.output and "No module named 'msprobe'" in res.output
    assert "NOT COMPARED; 1 of 1 pair(s) failed to compare" in res.output


def test_compare_never_reads_a_dump_outside_the_folder_given(tmp_path: Path) -> None:
    a = write_dump(tmp_path / "a" / "step0" / "rank0")
    outside = write_dump(tmp_path / "elsewhere")
    (tmp_path / "b" / "step0" / "rank0").mkdir(parents=True)
    (tmp_path / "b" / "step0" / "rank0" / "dump.json").symlink_to(outside)
    res = _run("compare", str(a.parent.parent.parent), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 1 and "is not inside" in res.output, res.output
    assert not list((tmp_path / "o" / "pairs").glob("0*"))


def test_progress_shows_the_running_verdict() -> None:
    from rl_msprobe.commands.dumps import running_verdict

    assert running_verdict({}) is None
    assert running_verdict({"consistent": 2}) == "CONSISTENT so far (2 consistent)"
    assert running_verdict({"consistent": 1, "failed": 1}).startswith("NOT COMPARED so far")
    assert running_verdict({"divergent": 1, "failed": 1}) == "DIVERGENT so far (1 divergent, 1 failed)"


def test_compare_names_the_training_backend_train_backend(tmp_path: Path) -> None:
    """--backend means the rollout engine (prepare, check); compare's training backend is
    --train-backend, with --backend its hidden old spelling (users' scripts keep working)."""
    shown = _run("compare", "--help").output
    assert "--train-backend [fsdp|megatron]" in shown and "--backend" not in shown
    for flag in ("--train-backend", "--backend"):
        res = _run("compare", str(tmp_path), str(tmp_path), "--out", str(tmp_path / "o"), flag, "tpu")
        assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output


def test_positions_and_compare_read_per_token_records(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.dumps import record_models as rm

    lengths = {"A": (3, 3), "B": (2, 4)}
    root = rm.write_job(
        tmp_path / "job" / "records",
        rm.tokens_of(lengths),
        {},
        rm.batched_schedule(lengths),
        [["A", "B"]],
        tp=2,
        plants=(rm.Plant("rollout", "model.layers.1.mlp.down_proj", "B", 3),),
    )
    out = _run("positions", str(root), "--out", str(tmp_path / "p"), "--json", "--estimate-bytes", "1000")
    assert out.exit_code == 1, out.output
    doc = json.loads(out.output)
    assert doc["schema"] == "rl-msprobe.dumps-positions/1" and doc["source"] == "records"
    assert doc["status"] == "divergent" and "position 3" in doc["verdict"] and "down_proj" in doc["verdict"]
    assert doc["bytes"]["rollout"] > 0 and doc["measured_over_estimate"] == pytest.approx(
        sum(doc["bytes"].values()) / 1000, rel=1e-3
    )
    assert [r["status"] for r in doc["requests"]] == ["consistent", "divergent"]
    assert (tmp_path / "p" / "positions.md").is_file()
    # the two side folders, and the front door on the parent dump folder
    sides = _run("positions", str(root / "rollout"), str(root / "train"), "--out", str(tmp_path / "q"))
    assert (
        sides.exit_code == 1 and "whole response" not in sides.output and "records: rollout" in sides.output
    )
    front = _run("compare", str(tmp_path / "job"), "--out", str(tmp_path / "c"))
    assert front.exit_code == 1, front.output
    assert "whole response (per-token records): A: CONSISTENT" in front.output
    doc = json.loads(_run("compare", str(tmp_path / "job"), "--out", str(tmp_path / "c"), "--json").output)
    assert (
        doc["status"] == "divergent"
        and doc["whole_response"]["source"] == "records"
        and not doc["prompt_only"]
    )
    nothing = _run("positions", str(tmp_path / "p"), "--out", str(tmp_path / "r"))
    assert nothing.exit_code == 2 and "no per-token records" in nothing.output

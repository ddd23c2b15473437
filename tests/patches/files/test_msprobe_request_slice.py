"""msprobe 26.2's per-request slice through rl-msprobe's real helpers, under the real msprobe on CPU.

A tiny per-token model (msprobe_slice_scenario.py) runs three requests in one forward: the vllm-dump
helper hands msprobe `scheduled_tokens` in the V1 runner's row order, the verl engine helper sets
msprobe's `slice` to the request's rows of a packed ([1, total_nnz]) or padded micro-batch. msprobe's
own compare (run by rl_msprobe.dumps.runners) of each sliced dump against a dump of the request
alone agrees on every row; the zoom (mix level, one layer's mlp, one request) on a planted 1% fault
names the API call inside that module where the difference starts.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from rl_msprobe.dumps.runners import ProcessRunner, interpreter
from rl_msprobe.dumps.zoom_operator import first_operator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCENARIO = Path(__file__).with_name("msprobe_slice_scenario.py")
RUNS = {  # name -> scenario arguments (request req-b, 5 of the 10 packed tokens, rows 3..7)
    "rollout_batch": ["rollout-batch"],
    "rollout_alone": ["rollout-alone"],
    "train_packed": ["train-packed"],
    "train_padded": ["train-padded"],
    "train_alone": ["train-alone"],
    "zoom_rollout": ["rollout-batch", "--level", "mix", "--list", "layers.1.mlp."],
    "zoom_train": ["train-packed", "--level", "mix", "--list", "layers.1.mlp.", "--fault", "0.01"],
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    base = tmp_path_factory.mktemp("slice")
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCENARIO), args[0], str(base / name), *args[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, args in RUNS.items()
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out.decode(errors='replace')[-3000:]}"
    return {name: base / name for name in RUNS} | {"base": base}


def only_dump(root: Path) -> Path:
    found = sorted(root.rglob("dump.json"))
    assert len(found) == 1, f"{root}: {found} (the step without the request must not be dumped)"
    return found[0]


def compare(dumps: dict[str, Path], target: str, golden: str) -> Path:
    out = dumps["base"] / f"cmp_{target}_{golden}"
    out.mkdir()
    args = [
        "compare",
        "-tp",
        str(only_dump(dumps[target])),
        "-gp",
        str(only_dump(dumps[golden])),
        "-o",
        str(out),
    ]
    rc = ProcessRunner(interpreter(None)).run(args, out / "log.txt", 300)
    assert rc == 0, (out / "log.txt").read_text()[-3000:]
    return next(out.glob("compare_result_*.csv"))


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def assert_same_rows(path: Path, shape: str) -> None:
    table = rows(path)
    assert table and all(r["Bench Name"] != "N/A" for r in table)
    assert all(r["Result"] == "pass" for r in table), [(r["NPU Name"], r["Result"]) for r in table]
    out = [r for r in table if r["NPU Name"] == "Module.model.layers.1.mlp.MLP.forward.0.output.0"]
    assert [r["NPU Tensor Shape"] for r in out] == [shape]


def test_rollout_step_of_three_requests_is_cut_to_the_request(dumps):
    """scheduled_tokens {req-a: 3, req-b: 5, req-c: 2} (vLLM ids carry -<8 hex>, msprobe's key is the
    base id): msprobe dumps rows 3..7 only, equal on every row to req-b run alone; the decode step
    without req-b is not dumped, and the dispatch log names only the dumped step."""
    assert_same_rows(compare(dumps, "rollout_batch", "rollout_alone"), "[5, 8]")
    logs = list(dumps["rollout_batch"].rglob("dispatch_log.jsonl"))
    assert len(logs) == 1 and len(logs[0].read_text().splitlines()) == 1


def test_packed_micro_batch_is_cut_on_dim_1(dumps):
    """rmpad [1, 10, H]: the helper's slice {dim 1, size 10, begin 3, end 8} from the nested
    input_ids' offsets; equal to req-b's own [1, 5, H] forward; the micro-batch without req-b is not
    dumped."""
    assert_same_rows(compare(dumps, "train_packed", "train_alone"), "[1, 5, 8]")


def test_padded_micro_batch_is_cut_to_the_sample_and_its_mask(dumps):
    """Left-padded [3, 5]: dim 0 the sample, dim 1 its attended positions."""
    assert_same_rows(compare(dumps, "train_padded", "train_alone"), "[1, 5, 8]")


def test_zoom_names_the_operator_inside_the_divergent_module(dumps):
    """Both sides at mix level, only `layers.1.mlp.` (msprobe's list), only req-b's rows; the training
    side's activation scaled by 1.01 inside layer 1's mlp. msprobe's compare of the two dumps, read
    by first_operator: the multiplication (Tensor.__mul__) in Module.model.layers.1.mlp, ~1%."""
    train = only_dump(dumps["zoom_train"])
    names = set(__import__("json").loads(train.read_text())["data"])
    assert names and all("layers.1.mlp" in n or not n.startswith("Module.") for n in names)
    found = first_operator(compare(dumps, "zoom_train", "zoom_rollout"), train)
    assert found is not None and found.api == "Tensor.__mul__", found
    assert found.module == "Module.model.layers.1.mlp.MLP.forward.0"
    assert 0.009 < found.rel_error < 0.011 and found.input_error == 0.0


def test_dumps_zoom_runs_the_compare_and_names_the_operator(dumps, tmp_path):
    """The user's command over the zoom's dump folder (actor/ and generate/, as prepare --zoom lays
    them out): msprobe's compare run, the operator named, exit 0; a folder without the two: exit 2."""
    import json
    import shutil

    from click.testing import CliRunner

    from rl_msprobe.cli import main

    folder = tmp_path / "dump"
    shutil.copytree(dumps["zoom_train"], folder / "actor")
    shutil.copytree(dumps["zoom_rollout"], folder / "generate")
    result = CliRunner().invoke(main, ["dumps", "zoom", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["operator"]["api"] == "Tensor.__mul__"
    assert doc["operator"]["module"] == "Module.model.layers.1.mlp.MLP.forward.0"
    text = CliRunner().invoke(main, ["dumps", "zoom", str(folder)])
    assert (
        text.output.startswith("operator: Tensor.__mul__ (") and "in Module.model.layers.1.mlp" in text.output
    )
    (tmp_path / "empty" / "actor").mkdir(parents=True)
    bad = CliRunner().invoke(main, ["dumps", "zoom", str(tmp_path / "empty")])
    assert bad.exit_code == 2 and "no msprobe dump.json with data" in bad.output

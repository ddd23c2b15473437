"""A verdict that cannot lie: NOT COMPARED when msprobe matched nothing (or too little), convention-only
rows set aside with their reason, dtype differences in the header; and the inputs rl-msprobe gives
msprobe (FSDP2 names, mix-level dumps) checked with the real msprobe where it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.dumps import inputs
from rl_msprobe.dumps.compare import CompareRun, PairResult
from rl_msprobe.dumps.correlate import Pair, Side
from rl_msprobe.dumps.report import dtype_line, verdict, write_report
from rl_msprobe.dumps.summary import GRAD_NOTE, summarize
from tests.dumps.test_summary import _csv

STATS_HEAD = [
    "NPU Name",
    "Bench Name",
    "NPU Dtype",
    "Bench Dtype",
    "NPU Tensor Shape",
    "Bench Tensor Shape",
    "Max diff",
    "NormRelativeErr",
    "Result",
    "Err_message",
]
FSDP2 = "Module.model.layers.{l}.{m}.forward.0.{x}"  # fully_shard keeps module names
FSDP1 = "Module._fsdp_wrapped_module.model.layers.{l}._fsdp_wrapped_module.{m}.forward.0.{x}"
VLLM = "Module.model.layers.{l}.{m}.forward.0.{x}"


def _stats_csv(path: Path, rows: list[list[str]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return _csv(path, rows, STATS_HEAD)


def _one_sided(train: str, rollout: str) -> list[list[str]]:
    """What msprobe writes when no training name meets a rollout name: every row on one side."""
    rows = []
    for m_t, m_r in (("mlp.down_proj.Linear", "mlp.down_proj.RowParallelLinear"),):
        for x in ("input.0", "output.0", "parameters.weight"):
            rows.append([train.format(l=0, m=m_t, x=x), "N/A", "torch.float32", "N/A", "[1, 4, 128]", "N/A"])
            rows.append(["N/A", rollout.format(l=0, m=m_r, x=x), "N/A", "torch.float32", "N/A", "[4, 128]"])
    return [r + ["N/A", "N/A", "pass", "[]"] for r in rows]


def _result(tmp_path: Path, rows: list[list[str]], n: int = 1, **kw) -> PairResult:
    d = tmp_path / f"p{n}"
    pair = Pair(f"req{n}", Side(100, 0, n, "r.json"), Side(200, 0, n, "t.json"))
    return PairResult(n, pair, d, csv=d / "c.csv", summary=summarize(_stats_csv(d, rows)), **kw)


def test_fsdp2_names_msprobe_cannot_match_are_not_compared(tmp_path: Path) -> None:
    run = CompareRun(out=tmp_path / "out", backend="fsdp")
    run.results.append(_result(tmp_path, _one_sided(FSDP2, VLLM)))
    assert run.results[0].summary.matched_rows == 0 and run.results[0].summary.consistent  # msprobe: no error
    assert run.results[0].status == "not compared" and not run.consistent
    line = verdict(run)
    assert line.startswith("NOT COMPARED: 1 of 1 pair(s); msprobe matched 0 of 6 rows"), line
    assert "CONSISTENT" not in line
    assert "NOT COMPARED" in write_report(run)["md"].read_text()
    assert run.to_json()["pairs"][0]["status"] == "not compared"


def _matched(train_dtype: str = "torch.float32", msg: str = "[]", result: str = "pass", layers=(0, 1, 2, 3)):
    rows = []
    for layer in layers:
        rows.append(
            [
                FSDP1.format(l=layer, m="mlp.down_proj.Linear", x="output.0"),
                VLLM.format(l=layer, m="mlp.down_proj.RowParallelLinear", x="output.0"),
                train_dtype,
                "torch.float32",
                "[4, 128]",
                "[4, 128]",
                "0.0",
                "0.0",
                result,
                msg,
            ]
        )
    return rows


def test_coverage_below_the_stated_share_is_not_compared(tmp_path: Path) -> None:
    rows = _matched(layers=(0,))
    for layer in (1, 2, 3):  # three of four rollout modules never met a training one
        rows.append(
            ["N/A", VLLM.format(l=layer, m="mlp.down_proj.RowParallelLinear", x="output.0")]
            + ["N/A", "torch.float32", "N/A", "[4, 128]", "N/A", "N/A", "pass", "[]"]
        )
    low = _result(tmp_path, rows)
    assert low.summary.coverage == pytest.approx(0.25) and low.status == "not compared"
    assert "1 of 4 rollout modules matched" in low.not_compared_reason
    assert _result(tmp_path, rows, 2, min_coverage=0.2).status == "consistent"


def test_consistent_says_how_many_rows_and_dtypes_in_header(tmp_path: Path) -> None:
    run = CompareRun(out=tmp_path / "out", backend="fsdp")
    run.results.append(_result(tmp_path, _matched("torch.bfloat16;torch.bfloat16")))
    assert verdict(run) == (
        "CONSISTENT: 1 pair(s), 4 matched row(s), 4 module output(s) judged; none exceeds its input's error "
        "and the noise floor (bf16 1.6%)"
    )
    assert dtype_line(run) == "dtypes differ (training -> rollout): torch.bfloat16 -> torch.float32 (4 rows)"
    md = write_report(run)["md"].read_text()
    assert "torch.bfloat16 -> torch.float32 (4 rows)" in md.split("## ")[0]  # in the header
    assert run.to_json()["dtypes"] == {"torch.bfloat16 -> torch.float32": 4}


def test_required_grad_alone_is_a_convention_numbers_still_count(tmp_path: Path) -> None:
    grad = '["error: The Required_Grad of NPU and Bench are inconsistent"]'
    only = _result(tmp_path, _matched(msg=grad, result="error"))
    assert only.status == "consistent"
    assert all(r.note == GRAD_NOTE and not r.divergent for r in only.summary.rows)
    both = json.dumps(
        [
            "error: The Required_Grad of NPU and Bench are inconsistent",
            "error: The NormRelativeErr of output is greater than 0.5.",
        ]
    )
    real = _result(tmp_path, _matched(msg=both, result="error"), 2)
    assert real.status == "divergent" and real.summary.first_divergence.layer == 0


def test_fsdp1_names_for_fsdp2_dumps() -> None:
    assert inputs.fsdp1_name("Module.model.layers.12.mlp.up_proj.Linear.forward.0") == (
        "Module._fsdp_wrapped_module.model.layers.12._fsdp_wrapped_module.mlp.up_proj.Linear.forward.0"
    )
    assert (
        inputs.fsdp1_name("Module.lm_head.Linear.forward.0")
        == "Module._fsdp_wrapped_module.lm_head.Linear.forward.0"
    )
    assert inputs.fsdp1_name("Functional.linear.0.forward") == "Functional.linear.0.forward"
    assert inputs.needs_fsdp1_names(["Module.model.norm.RMSNorm.forward.0", "Tensor.add.0.forward"])
    assert not inputs.needs_fsdp1_names([inputs.fsdp1_name("Module.model.norm.RMSNorm.forward.0")])


def test_prepared_inputs_keep_values_and_leave_originals(tmp_path: Path) -> None:
    entry = {"output": [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0}]}
    doc = {
        "task": "statistics",
        "level": "mix",
        "framework": "pytorch",
        "dump_data_dir": None,
        "data": {"Functional.linear.0.forward": entry, "Module.model.layers.0.mlp.Qwen2MLP.forward.0": entry},
    }
    train, rollout = tmp_path / "t" / "dump.json", tmp_path / "r" / "dump.json"
    for p in (train, rollout):
        p.parent.mkdir()
        p.write_text(json.dumps(doc))
    before = train.read_bytes()
    got = inputs.prepare(train, rollout, tmp_path / "in", "fsdp")
    assert train.read_bytes() == before
    t, r = json.loads(got.train.read_text()), json.loads(got.rollout.read_text())
    assert list(t["data"]) == [
        "Module._fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.Qwen2MLP.forward.0"
    ]
    assert list(r["data"]) == ["Module.model.layers.0.mlp.Qwen2MLP.forward.0"]
    assert list(t["data"].values()) == [entry] and t["level"] == "mix"
    assert len(got.notes) == 3  # API rows left out on each side, FSDP1 names on the training side
    plain = {**doc, "level": "L0", "data": {"Module._fsdp_wrapped_module.x.X.forward.0": entry}}
    train.write_text(json.dumps(plain))
    rollout.write_text(json.dumps({**plain, "data": {"Module.x.X.forward.0": entry}}))
    same = inputs.prepare(train, rollout, tmp_path / "in2", "fsdp")
    assert (same.train, same.rollout, same.notes) == (train, rollout, [])


# ------------------------------------------------------------------ with the real msprobe
def _stat(shape: list[int], scale: float = 1.0, grad: bool = False) -> dict:
    return {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": shape,
        "Max": 0.5 * scale,
        "Min": -0.5 * scale,
        "Mean": 0.01 * scale,
        "Norm": 3.0 * scale,
        "requires_grad": grad,
    }


def _dump(path: Path, data: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    f = path / "dump.json"
    doc = {"task": "statistics", "level": "mix", "framework": "pytorch", "dump_data_dir": None, "data": data}
    f.write_text(json.dumps(doc))
    return f


def _module(
    inp: list[int], out: list[int], w: list[int] | None, scale: float = 1.0, grad: bool = False
) -> dict:
    entry = {"input_args": [_stat(inp)], "input_kwargs": {}, "output": [_stat(out, scale, grad)]}
    if w:
        entry["parameters"] = {"weight": _stat(w, grad=grad)}
    return entry


def _sides(tmp_path: Path, down_scale: float = 1.0) -> tuple[Path, Path]:
    """An FSDP2 training dump (no wrapper in the names, params require grad, mix level with API
    rows) and a vLLM-named rollout dump of the same numbers, two decoder layers."""
    t, r = {}, {}
    t["Functional.embedding.0.forward"] = _module([1, 4], [1, 4, 8], None)
    r["Functional.embedding.0.forward"] = _module([4], [4, 8], None)
    for layer in (0, 1):
        scale = down_scale if layer == 1 else 1.0
        t[f"Module.model.layers.{layer}.mlp.down_proj.Linear.forward.0"] = _module(
            [1, 4, 16], [1, 4, 8], [8, 16], scale, True
        )
        t[f"Tensor.__add__.{layer}.forward"] = _module([1, 4, 8], [1, 4, 8], None)
        t[f"Module.model.layers.{layer}.mlp.Qwen2MLP.forward.0"] = _module(
            [1, 4, 8], [1, 4, 8], None, scale, True
        )
        r[f"Tensor.__add__.{1 - layer}.forward"] = _module([4, 8], [4, 8], None)
        r[f"Module.model.layers.{layer}.mlp.down_proj.RowParallelLinear.forward.0"] = _module(
            [4, 16], [4, 8], [8, 16]
        )
        r[f"Module.model.layers.{layer}.mlp.Qwen2MLP.forward.0"] = _module([4, 8], [4, 8], None)
    return _dump(tmp_path / "train" / "step0" / "rank0", t), _dump(tmp_path / "gen" / "step0" / "rank0", r)


def _cli(*args: str):
    return CliRunner().invoke(main, ["dumps", "compare", *args, "--json"])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_real_msprobe_fsdp2_mix_dumps(tmp_path: Path) -> None:
    """msprobe as it is: FSDP2 names give 0 matched rows (NOT COMPARED), mix API rows make it
    raise; rl-msprobe's inputs make it match every module; a perturbed layer is found."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    from rl_msprobe.dumps.runners import ProcessRunner, interpreter

    train, rollout = _sides(tmp_path)
    raw = tmp_path / "raw"
    raw.mkdir()
    module_only = {}
    for side, path in (("train", train), ("rollout", rollout)):  # msprobe on the L0 rows as they are
        doc = json.loads(path.read_text())
        doc["data"] = inputs.module_rows_only(doc["data"])
        module_only[side] = _dump(raw / side, doc["data"])
    runner = ProcessRunner(interpreter(None))
    mixed = ["compare", "-tp", str(train), "-gp", str(rollout), "--consistent_check", "--backend", "fsdp"]
    assert runner.run([*mixed, "-o", str(raw)], raw / "mix.log", 240) == 1
    assert "cannot be monotonically increasing" in (raw / "mix.log").read_text()
    args = [
        "compare",
        "-tp",
        str(module_only["train"]),
        "-gp",
        str(module_only["rollout"]),
        "--consistent_check",
    ]
    rc = runner.run([*args, "--backend", "fsdp", "-o", str(raw)], raw / "log", 240)
    assert rc == 0, (raw / "log").read_text()[-2000:]
    pair = PairResult(1, Pair("x", Side(None, None, None, None), Side(None, None, None, None)), raw)
    pair.summary = summarize(next(raw.glob("compare_result_*.csv")))
    assert pair.summary.matched_rows == 0 and pair.status == "not compared"

    res = _cli(str(rollout.parent), str(train.parent), "--out", str(tmp_path / "ok"), "-j", "1")
    doc = json.loads(res.stdout)
    assert res.exit_code == 0, json.dumps(doc, indent=1)[:4000]
    s = doc["pairs"][0]["summary"]
    assert doc["verdict"].startswith("CONSISTENT") and s["matched_rows"] >= 8 and s["coverage"] == 1.0
    assert any("FSDP1" in n for n in doc["pairs"][0]["inputs"])

    train2, rollout2 = _sides(tmp_path / "bad", down_scale=3.0)
    res = _cli(str(rollout2.parent), str(train2.parent), "--out", str(tmp_path / "bad_out"), "-j", "1")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["verdict"].startswith("DIVERGENT"), doc["verdict"]
    assert doc["pairs"][0]["summary"]["first_divergence"]["layer"] == 1


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_worker_writes_the_same_rows_as_a_process_per_pair(tmp_path: Path) -> None:
    """Issue 14: the long-lived worker path and the former one-process-per-pair path give
    byte-identical CSV rows for the same pairs (a divergent and a consistent one)."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    from rl_msprobe.dumps.compare import compare_pairs, plain_pairs

    for n, scale in ((0, 1.0), (1, 3.0)):
        train, rollout = _sides(tmp_path / f"s{n}", down_scale=scale)
        for side, src in (("train", train), ("gen", rollout)):
            dest = tmp_path / side / f"step{n}" / "rank0"
            dest.mkdir(parents=True)
            (dest / "dump.json").write_bytes(src.read_bytes())
    pairs = plain_pairs(tmp_path / "gen", tmp_path / "train")
    assert len(pairs) == 2
    rows = {}
    for label, per_process in (("worker", False), ("process", True)):
        results = compare_pairs(pairs, tmp_path / label, "fsdp", jobs=1, per_process=per_process)
        assert [r.status for r in results] == ["consistent", "divergent"], [r.error for r in results]
        rows[label] = [r.csv.read_bytes().splitlines() for r in results]
    assert rows["worker"] == rows["process"]


def test_fused_add_rmsnorm_inputs_are_not_comparable_with_their_reason(tmp_path: Path) -> None:
    """vLLM's post_attention_layernorm takes (hidden, residual); the training norm takes their
    sum: a shape-only complaint on input.0 is read by that convention, not as a 1-dim squeeze."""
    norm_t, norm_r = "post_attention_layernorm.Qwen2RMSNorm", "post_attention_layernorm.RMSNorm"
    complaint = json.dumps(
        [
            "error: The Required_Grad of NPU and Bench are inconsistent",
            "error: The shape of NPU and Bench are inconsistent.",
        ]
    )
    rows = [
        [
            FSDP1.format(l=1, m=norm_t, x="input.0"),
            VLLM.format(l=1, m=norm_r, x="input.0"),
            "torch.float32",
            "torch.float32",
            "[1, 4, 128]",
            "[4, 128]",
            "0.3",
            "0.2",
            "error",
            complaint,
        ],
        ["N/A", VLLM.format(l=1, m=norm_r, x="input.1"), "N/A", "torch.float32", "N/A", "[4, 128]"]
        + ["N/A", "N/A", "pass", "[]"],
        *_matched(),
    ]
    r = _result(tmp_path, rows)
    first = r.summary.rows[0]
    assert not first.comparable and "fused add-RMSNorm" in first.note
    assert r.status == "consistent"

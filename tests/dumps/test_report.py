"""report.md / report.html from summaries built on hand-made CSVs (no msprobe run needed)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from rl_msprobe.dumps.compare import CompareRun, PairResult
from rl_msprobe.dumps.correlate import Correlation, Pair, Side, Unmatched
from rl_msprobe.dumps.report import write_report
from rl_msprobe.dumps.summary import summarize
from tests.dumps.test_summary import _csv, _row


def _run(tmp_path: Path, n_pairs: int, diverge: bool) -> CompareRun:
    run = CompareRun(out=tmp_path / "out", backend="fsdp", correlation=Correlation())
    run.correlation.unmatched.append(Unmatched("cccc", "rollout", "prefilled together with other requests"))
    run.correlation.skipped["rollout: decode step"] = 7
    for i in range(1, n_pairs + 1):
        bad = diverge and i == 2
        rows = [
            _row(0, "mlp.Qwen2MLP", "mlp.Qwen2MLP", "output.0", "1.0", f"{i}e-7"),
            _row(
                1,
                "mlp.Qwen2MLP",
                "mlp.Qwen2MLP",
                "output.0",
                "0.5" if bad else "1.0",
                "0.3" if bad else "1e-6",
                "error" if bad else "pass",
                '["error: One Thousandth Err Ratio"]' if bad else "[]",
            ),
        ]
        d = tmp_path / f"p{i}"
        d.mkdir()
        pair = Pair(f"req{i}", Side(100, 0, i, "r.json"), Side(200, 0, i, "t.json"))
        run.results.append(PairResult(i, pair, d, csv=d / "c.csv", summary=summarize(_csv(d, rows))))
    return run


def _png_from_html(text: str) -> bytes:
    m = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert m, "no embedded PNG"
    return base64.b64decode(m.group(1))


def test_divergent_report(tmp_path: Path) -> None:
    run = _run(tmp_path, 3, diverge=True)
    paths = write_report(run)
    md = paths["md"].read_text()
    assert (
        "**DIVERGENT: 1 of 3 pair(s); first divergence model.layers.1.mlp output.0 (layer 1) in all 1 pair(s); "
        "pairs agree**" in md
    )
    assert (
        "| 2 | `req2` | 100/step2/rank0 | 200/step2/rank0 | divergent | 1 | 1 / 0 / 1 | 0 | 2/2, 100% "
        "| `model.layers.1.mlp output.0` |" in md
    )
    # every pair's first divergence with its ratio to the floor, msprobe's word beside
    assert "pair 2 (`req2`): `model.layers.1.mlp output.0` — output error " in md and "msprobe: error" in md
    assert "noise floor (relative error of identical weights" in md.split("## ")[0]
    assert "prefilled together with other requests" in md and "rollout: decode step: 7" in md
    html = paths["html"].read_text()
    assert _png_from_html(html)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"(src|href)=['\"](https?:|//|file:)", html), "report.html must be self-contained"
    assert "model.layers.1.mlp" in html and "DIVERGENT" in html
    assert "## Module outputs ranked by rl-msprobe's judgement" in md and "DIVERGES" in md
    ranked = md.split("## Module outputs ranked")[1].split("##")[0].splitlines()
    assert "DIVERGES" in ranked[4], ranked  # the finding comes first
    assert "<h2>Module outputs ranked by rl-msprobe&#x27;s judgement" in html
    assert paths["png"].read_bytes() == _png_from_html(html)


def test_consistent_report_and_many_pairs(tmp_path: Path) -> None:
    run = _run(tmp_path, 10, diverge=False)  # > 8 pairs: worst and median lines instead of one per pair
    paths = write_report(run)
    assert run.consistent
    assert (
        paths["md"].read_text().splitlines()[2]
        == "**CONSISTENT: 10 pair(s), 20 matched row(s), 20 module output(s) judged; none exceeds its input's "
        "error and the noise floor (fp32 0.01%)**"
    )
    md = paths["md"].read_text()
    assert "Lowest-scoring" not in md and "DIVERGES" not in md and "| within |" in md
    assert "error 139" not in md and "| 1 / 0 / 0 |" not in md  # msprobe's counts say whose they are
    assert len(_png_from_html(paths["html"].read_text())) > 10_000


def test_failed_pair_is_reported(tmp_path: Path) -> None:
    run = CompareRun(out=tmp_path / "out", backend="megatron")
    run.results.append(
        PairResult(
            1,
            Pair("x", Side(1, 0, 0, "a"), Side(2, 0, 0, "b")),
            tmp_path,
            error="msprobe compare exited 1; boom",
        )
    )
    paths = write_report(run)
    assert not run.consistent
    md = paths["md"].read_text()
    assert "**NOT COMPARED; 1 of 1 pair(s) failed to compare**" in md and "boom" in md
    assert "data:image/png" not in paths["html"].read_text()  # nothing to plot, no broken image


def test_without_matplotlib_the_report_is_written_and_says_so(tmp_path: Path, monkeypatch) -> None:
    """Issue 20: `dumps compare` crashed in the report writer when matplotlib was missing."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    run = _run(tmp_path, 3, diverge=True)
    paths = write_report(run)
    assert "png" not in paths and not (run.out / "report.png").exists()
    md, html = paths["md"].read_text(), paths["html"].read_text()
    assert "No plot: matplotlib is not installed" in md and "No plot: matplotlib is not installed" in html
    assert "DIVERGENT" in md and run.to_json()["no_plot"].startswith("matplotlib is not installed")


def test_cosine_panel_only_in_tensor_mode(tmp_path: Path) -> None:
    """Statistics dumps have no cosine: the plot has one panel (error), not an empty cosine one."""
    import io

    from matplotlib import image

    from rl_msprobe.dumps.report import plot_png

    (tmp_path / "t").mkdir()
    tensor = _run(tmp_path / "t", 2, diverge=False)
    png, _ = plot_png(tensor)
    assert image.imread(io.BytesIO(png)).shape[0] > 600  # two panels: 6.2 in at 110 dpi
    stats = CompareRun(out=tmp_path / "s", backend="fsdp")
    from tests.dumps.test_verdict import _matched, _result

    stats.results.append(_result(tmp_path / "s", _matched()))
    png, _ = plot_png(stats)
    assert image.imread(io.BytesIO(png)).shape[0] < 450  # one panel: 3.6 in

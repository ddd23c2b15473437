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
            _row(0, "mlp.Qwen2MLP", "mlp.Qwen2MLP", "output.0", "0.99999", f"{i}e-7"),
            _row(
                1,
                "mlp.Qwen2MLP",
                "mlp.Qwen2MLP",
                "output.0",
                "0.5" if bad else "0.9999",
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
    assert "**DIVERGENT: 1 of 3 pair(s); first divergence model.layers.1.mlp output.0 (layer 1)**" in md
    assert (
        "| 2 | `req2` | 100/step2/rank0 | 200/step2/rank0 | divergent | 1 | 0 | 1 | 0 | 2/2, 100% | `model.layers.1.mlp output.0` |"
        in md
    )
    assert "prefilled together with other requests" in md and "rollout: decode step: 7" in md
    html = paths["html"].read_text()
    assert _png_from_html(html)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"(src|href)=['\"](https?:|//|file:)", html), "report.html must be self-contained"
    assert "model.layers.1.mlp" in html and "DIVERGENT" in html
    assert "## Worst rows" in md and "<h2>Worst rows</h2>" in html
    assert paths["png"].read_bytes() == _png_from_html(html)


def test_consistent_report_and_many_pairs(tmp_path: Path) -> None:
    run = _run(tmp_path, 10, diverge=False)  # > 8 pairs: worst and median lines instead of one per pair
    paths = write_report(run)
    assert run.consistent
    assert (
        paths["md"].read_text().splitlines()[2]
        == "**CONSISTENT: 10 pair(s), 20 matched row(s) compared, no row beyond msprobe's thresholds**"
    )
    # the lowest rows of a consistent compare are not called "worst"
    md = paths["md"].read_text()
    assert "## Lowest-scoring rows (all within msprobe's thresholds)" in md and "## Worst rows" not in md
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

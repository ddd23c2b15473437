"""End to end with real msprobe: real dumps and logs, `correlate`, `compare`, the report.

STAND-IN: until the vLLM CPU venv patched with `vllm-dump` and the verl training helper can
run here, `standin.py` plays both sides with a tiny Qwen2 (same random weights): the rollout
side is a module tree named like vLLM's Qwen2 (fused qkv_proj / gate_up_proj), the training
side is transformers' Qwen2ForCausalLM named the way FSDP1 wraps it, run through rl-msprobe's
real training helper (verl/utils/rl_msprobe_hooks.py). Each side is its own process
(PrecisionDebugger is a per-process singleton) and writes the DOMAIN §6 logs.
The compare itself is msprobe's own `msprobe compare --consistent_check --backend fsdp`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from tests.support import standin_dumps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
PERTURBED_LAYER = standin_dumps.PERTURBED_LAYER


@pytest.fixture(scope="module")
def sides() -> dict[str, Path]:
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    pytest.importorskip("transformers", reason="transformers is in the `test` extra")
    return standin_dumps.build()  # built once per session, shared with the docs' quickstart check


def _compare(sides: dict[str, Path], train: str, out: str, rollout: str = "rollout"):
    res = CliRunner().invoke(
        main,
        [
            "dumps",
            "compare",
            str(sides[rollout]),
            str(sides[train]),
            "--out",
            str(sides["base"] / out),
            "-j",
            "2",
            "--json",
        ],
    )
    return res, json.loads(res.stdout) if res.stdout.strip().startswith("{") else None


def test_check_and_correlate(sides: dict[str, Path]) -> None:
    runner = CliRunner()
    check = runner.invoke(main, ["dumps", "check", str(sides["rollout"]), str(sides["train"]), "--json"])
    doc = json.loads(check.stdout)
    assert check.exit_code == 0 and doc["mode"] == "consistency", doc["problems"]
    assert doc["dumps"] == 4 + 2  # rollout: 4 model steps; training: 2 micro-batches
    res = runner.invoke(main, ["dumps", "correlate", str(sides["rollout"]), str(sides["train"]), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    got = {p["request_id"]: (p["rollout"]["step"], p["train"]["step"]) for p in doc["pairs"]}
    # ids in the dispatch log carry vLLM's -<8 hex> suffix; the training log has them bare
    assert got == {"3f2a9c1e7b6d4e5fa0b1c2d3e4f50617": (0, 0), "9a8b7c6d5e4f40312a1b2c3d4e5f6071": (2, 1)}
    assert [u["request_id"] for u in doc["unmatched"]] == ["0c1d2e3f4a5b46c7d8e9f0a1b2c3d4e5"]
    assert doc["skipped_lines"]["rollout: decode step"] == 1


def test_identical_weights_are_consistent(sides: dict[str, Path]) -> None:
    res, doc = _compare(sides, "train", "out_same")
    assert doc is not None, res.output
    assert res.exit_code == 0, json.dumps(doc, indent=1)[:4000]
    assert doc["consistent"] and len(doc["pairs"]) == 2
    for pair in doc["pairs"]:
        s = pair["summary"]
        assert s["mode"] == "tensor" and s["first_divergence"] is None
        assert s["counts"]["pass"] > 50  # msprobe really matched and measured rows
        assert all(p["cosine"] is None or p["cosine"] > 0.9999 for p in s["layers"])
    md = (sides["base"] / "out_same" / "report.md").read_text()
    assert md.splitlines()[2].startswith("**CONSISTENT: 2 pair(s)")


def test_perturbed_layer_is_the_first_divergence(sides: dict[str, Path]) -> None:
    res, doc = _compare(sides, "train_perturbed", "out_perturbed")
    assert doc is not None, res.output
    assert res.exit_code == 1 and not doc["consistent"]
    for pair in doc["pairs"]:
        first = pair["summary"]["first_divergence"]
        assert first is not None, pair
        assert first["layer"] == PERTURBED_LAYER and first["module"].startswith(
            f"model.layers.{PERTURBED_LAYER}.mlp"
        )
        before = [p for p in pair["summary"]["layers"] if p["depth"] < PERTURBED_LAYER]
        assert before and all(p["divergent"] == 0 and p["cosine"] > 0.9999 for p in before)
        at = next(p for p in pair["summary"]["layers"] if p["depth"] == PERTURBED_LAYER)
        assert at["cosine"] < 0.95
    md = (sides["base"] / "out_perturbed" / "report.md").read_text()
    assert f"first divergence model.layers.{PERTURBED_LAYER}.mlp" in md


def test_plain_folders_and_a_broken_dump(sides: dict[str, Path]) -> None:
    """No logs: two step/rank folders compared one to one; a cut-short dump.json is a failed pair."""
    (r_dir,) = sides["rollout"].glob("*/step0/*")
    (t_dir,) = sides["train"].glob("step0/*")
    runner = CliRunner()
    res = runner.invoke(
        main, ["dumps", "compare", str(r_dir), str(t_dir), "--out", str(sides["base"] / "plain"), "--json"]
    )
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["consistent"] and len(doc["pairs"]) == 1, res.output[:3000]
    broken = sides["base"] / "broken" / "step0" / "rank0"
    shutil.copytree(t_dir, broken)
    text = (broken / "dump.json").read_text()
    (broken / "dump.json").write_text(text[: len(text) // 2])
    res = runner.invoke(
        main, ["dumps", "compare", str(r_dir), str(broken), "--out", str(sides["base"] / "plain_broken")]
    )
    assert res.exit_code == 1
    assert "failed" in res.output
    assert "1 pair(s) failed to compare" in (sides["base"] / "plain_broken" / "report.md").read_text()


def test_statistics_dumps(sides: dict[str, Path]) -> None:
    """Statistics dumps: msprobe's statistics checkers, plotted by its Max diff; same verdicts."""
    res, doc = _compare(sides, "train_stats", "out_stats_same", rollout="rollout_stats")
    assert doc is not None and res.exit_code == 0 and doc["consistent"], res.output[:4000]
    assert {p["summary"]["mode"] for p in doc["pairs"]} == {"statistics"}
    res, doc = _compare(sides, "train_stats_perturbed", "out_stats", rollout="rollout_stats")
    assert doc is not None and res.exit_code == 1
    for pair in doc["pairs"]:
        first = pair["summary"]["first_divergence"]
        assert first["layer"] == PERTURBED_LAYER and first["cosine"] is None and first["max_abs_err"] > 0
    assert (sides["base"] / "out_stats" / "report.png").stat().st_size > 10_000


def _chromium() -> str | None:
    return next(
        (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None
    )


def test_html_screenshot_shows_the_plot(sides: dict[str, Path]) -> None:
    """The report in a real browser: headless Chromium (Debian `chromium`, which `.ci/run` installs)."""
    browser = _chromium()
    if browser is None:
        pytest.skip(
            "Chromium is not installed, so report.html was NOT checked in a browser "
            "(Debian/Ubuntu: apt-get install chromium; .ci/run installs it)"
        )
    html = sides["base"] / "out_perturbed" / "report.html"
    if not html.exists():
        _compare(sides, "train_perturbed", "out_perturbed")
    shot = sides["base"] / "report_screenshot.png"
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            # a closed network: no background connections, updates, sync or QUIC lookups
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
            "--no-first-run",
            f"--user-data-dir={sides['base'] / 'chromium-profile'}",  # a new empty profile
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1200,1400",
            f"--screenshot={shot}",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shot.exists(), f"Chromium wrote no screenshot: {proc.stderr[-2000:]}"
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(shot)[..., :3]
    # the plot's first line colour (matplotlib C0, #1f77b4) must be on screen: the PNG rendered
    c0 = np.array([0x1F, 0x77, 0xB4]) / 255
    assert (np.abs(img - c0).max(axis=-1) < 0.08).sum() > 200
    # and the verdict banner (red on pink) above it
    assert (np.abs(img - np.array([0xFC, 0xE8, 0xE6]) / 255).max(axis=-1) < 0.02).sum() > 2000

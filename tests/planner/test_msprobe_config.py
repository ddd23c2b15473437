"""msprobe configs: the validator's rules, and real msprobe dumping with the configs we write."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_msprobe.planner.msprobe_config import build_config, validate


@pytest.mark.parametrize("role", ["training", "generate", "actor"])
@pytest.mark.parametrize("level", ["mix", "L0", "L1"])
def test_built_configs_are_valid(role: str, level: str) -> None:
    doc = build_config(role, None if role == "training" else "/abs/dump", level=level, steps=[0], ranks=[])
    assert validate(doc, role) == []
    assert doc["level"] == level
    assert doc["risk_level"] == "FOCUS"  # said explicitly, so the dump never depends on msprobe's default
    assert ("dump_path" in doc) is (role != "training")


def test_risk_level_is_checked() -> None:
    assert build_config("generate", "/x", risk_level="FOCUS")["risk_level"] == "FOCUS"
    with pytest.raises(ValueError, match="risk_level 'LOW'"):
        build_config("generate", "/x", risk_level="LOW")
    wrong = validate({"task": "statistics", "dump_path": "/x", "risk_level": "LOW"}, "generate")
    assert [(p.key, p.severity) for p in wrong] == [("risk_level", "error")]
    unset = validate({"task": "statistics", "dump_path": "/x", "level": "mix"}, "generate")
    assert [(p.key, p.severity) for p in unset] == [("risk_level", "warning")]
    assert "FOCUS" in unset[0].message and "reshape" in unset[0].message
    # L0 dumps modules only: the risk level filters nothing there
    assert validate({"task": "statistics", "dump_path": "/x", "level": "L0"}, "generate") == []


@pytest.mark.parametrize(
    ("doc", "role", "key"),
    [
        ({"task": "statistics", "dump_path": "/x", "level": "mix"}, "training", "dump_path"),
        ({"task": "statistics", "level": "mix"}, "generate", "dump_path"),
        ({"task": "statistics", "dump_path": "/with space", "level": "mix"}, "generate", "dump_path"),
        ({"task": "overflow_check", "dump_path": "/x"}, "generate", "task"),
        ({"task": "statistics", "dump_path": "/x", "level": "L9"}, "generate", "level"),
        ({"task": "statistics", "dump_path": "/x", "step": [-1]}, "generate", "step"),
        ({"task": "statistics", "dump_path": "/x", "rank": ["3-1"]}, "generate", "rank"),
        ({"task": "tensor", "dump_path": "/x", "level": "L2", "tensor": {"list": []}}, "generate", "level"),
        (
            {"task": "statistics", "dump_path": "/x", "statistics": {"scope": ["a"]}},
            "generate",
            "statistics.scope",
        ),
        (
            {"task": "statistics", "dump_path": "/x", "statistics": {"data_mode": ["all", "input"]}},
            "generate",
            "statistics.data_mode",
        ),
        (
            {"task": "statistics", "dump_path": "/x", "statistics": {"summary_mode": "max"}},
            "generate",
            "statistics.summary_mode",
        ),
    ],
)
def test_validator_errors(doc: dict, role: str, key: str) -> None:
    problems = [p for p in validate(doc, role) if p.severity == "error"]
    assert key in [p.key for p in problems], problems


def test_unknown_keys_are_warnings() -> None:
    problems = validate(
        {"task": "statistics", "dump_path": "/x", "dumppath": "/y", "risk_level": "ALL"}, "generate"
    )
    assert [(p.key, p.severity) for p in problems] == [("dumppath", "warning")]


DUMP_RUN = textwrap.dedent(
    """
    import sys, torch
    from msprobe.pytorch import PrecisionDebugger
    config, dump_path = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    debugger = PrecisionDebugger(config_path=config, dump_path=dump_path) if dump_path else PrecisionDebugger(config_path=config)
    class Reshaped(torch.nn.Module):
        def forward(self, x):
            return x.reshape(3, 2, 4).transpose(0, 1).reshape(2, 12)  # low-risk calls (FOCUS drops them)

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Reshaped(), torch.nn.Linear(12, 2))
    debugger.start(model=model)
    model(torch.randn(3, 4))
    debugger.stop()
    debugger.step()
    """
)


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["training", "generate"])
def test_real_msprobe_dumps_with_our_configs(role: str, tmp_path: Path) -> None:
    """The configs prepare writes make real msprobe (CPU) write dump.json, at level mix."""
    pytest.importorskip("msprobe")
    dump = tmp_path / "dump"
    doc = build_config(role, None if role == "training" else str(dump), level="mix", steps=[0])
    config = tmp_path / "config.json"
    config.write_text(json.dumps(doc))
    # training: verl passes the dump path itself (PrecisionDebugger(config_path, dump_path=...))
    args = [sys.executable, "-c", DUMP_RUN, str(config), *([str(dump)] if role == "training" else [])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dumps = list(dump.rglob("dump.json"))
    assert dumps, proc.stdout[-2000:]
    data = json.loads(dumps[0].read_text())
    assert data["level"] == "mix" and data["data"]
    assert any(name.startswith("Module.") for name in data["data"]) and any(
        name.startswith("Functional.") for name in data["data"]
    )


@pytest.mark.e2e
@pytest.mark.parametrize("risk_level", ["ALL", "FOCUS"])
def test_real_msprobe_keeps_what_the_risk_level_says(risk_level: str, tmp_path: Path) -> None:
    """What the docs say FOCUS drops, real msprobe drops: reshape / transpose rows go, the linear stays."""
    pytest.importorskip("msprobe")
    dump = tmp_path / "dump"
    doc = build_config("generate", str(dump), level="mix", steps=[0], risk_level=risk_level)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(doc))
    proc = subprocess.run(
        [sys.executable, "-c", DUMP_RUN, str(config)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = list(json.loads(next(dump.rglob("dump.json")).read_text())["data"])
    low_risk = [n for n in names if ".reshape." in n or ".transpose." in n]
    assert any(".linear." in n for n in names), names
    assert any(n.startswith("Module.") for n in names), names
    assert bool(low_risk) is (risk_level == "ALL"), names

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
    assert ("dump_path" in doc) is (role != "training")


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
    problems = validate({"task": "statistics", "dump_path": "/x", "dumppath": "/y"}, "generate")
    assert [(p.key, p.severity) for p in problems] == [("dumppath", "warning")]


DUMP_RUN = textwrap.dedent(
    """
    import sys, torch
    from msprobe.pytorch import PrecisionDebugger
    config, dump_path = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    debugger = PrecisionDebugger(config_path=config, dump_path=dump_path) if dump_path else PrecisionDebugger(config_path=config)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
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

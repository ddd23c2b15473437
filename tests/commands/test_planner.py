"""The thin command layer: light imports, one JSON document with --json, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.planner.conftest import CORPUS

PROBE = """
import sys
from rl_msprobe.cli import main
try:
    main([{args}])
except SystemExit:
    pass
heavy = sorted(m for m in ("libcst", "git", "hydra", "unidiff") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize(
    "args", ["'--help'", "'env', '--help'", "'prepare', '--help'", "'check', '--help'", "'detect', '--help'"]
)
def test_help_does_not_import_heavy_libraries(args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY=", proc.stdout


def test_json_is_the_only_thing_on_stdout(tmp_path: Path) -> None:
    script = tmp_path / "run_a.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    for args in (
        ["detect", str(script)],
        ["check", str(script), "--mode", "inference"],
        ["prepare", str(script), "--mode", "training"],
    ):
        proc = subprocess.run(
            [sys.executable, "-c", "from rl_msprobe.cli import main; main()", *args, "--json"],
            capture_output=True,
            text=True,
        )
        doc = json.loads(proc.stdout)  # exactly one document
        assert isinstance(doc, dict) and proc.returncode in (0, 1)


def test_bad_input_exits_2_with_the_fix(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rl_msprobe.cli import main; main()",
            "check",
            str(tmp_path / "nope.sh"),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == "" and "Pass the verl launch script" in proc.stderr

"""The patch-set registry is one explicit table: complete however it is first reached (a set module
imported first included), and every set module's sets are in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIST = "from rl_msprobe.patches import all_sets; print(json.dumps([s.name for s in all_sets()]))"


def _names(first_import: str) -> list[str]:
    """The sets `all_sets()` lists in a fresh interpreter that imports `first_import` before anything else."""
    code = f"import json, {first_import}; {LIST}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "module",
    [
        "rl_msprobe.patches.vllm",
        "rl_msprobe.patches.verl_triage",
        "rl_msprobe.patches.sglang",
        "rl_msprobe.engine.writer",
    ],
)
def test_importing_one_set_module_first_still_lists_every_set(module: str) -> None:
    assert _names(module) == _names("rl_msprobe")


def test_every_set_module_registers_something() -> None:
    names = _names("rl_msprobe")
    for expected in ("verl-engine", "verl-triage", "sglang-dump", "vllm-dump", "vllm-ascend-dispatch-log"):
        assert expected in names


def test_the_registry_is_the_set_modules_tables_in_order() -> None:
    from rl_msprobe.patches import SETS, sglang, verl, verl_triage, verl_weights, vllm, vllm_ascend

    modules = (verl, verl_triage, verl_weights, sglang, vllm_ascend, vllm)
    assert all(module.SETS for module in modules)
    assert tuple(s for module in modules for s in module.SETS) == SETS

"""The patch-set registry is one explicit table of rows: complete however it is first reached (a set
module imported first included), every set module's sets are rows of it, and a set's module is
imported only when the set is used."""

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


def test_the_registry_rows_are_the_set_modules_tables() -> None:
    import importlib

    from rl_msprobe.patches import ROWS, all_sets

    assert [s.name for s in all_sets()] == [row.name for row in ROWS]
    for module in {row.module for row in ROWS}:
        sets = importlib.import_module(f"rl_msprobe.patches.{module}").SETS
        assert [s.name for s in sets] == [row.name for row in ROWS if row.module == module], module
    assert all(s.project == row.project for s, row in zip(all_sets(), ROWS, strict=True))


STATUS_IMPORTS = """
import json, sys
from rl_msprobe.cli import main
try:
    main(["patch", "status", "verl-engine", "--tree", sys.argv[1]])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("rl_msprobe.codemods.", "rl_msprobe.patches.")))))
print(json.dumps("libcst.matchers" in sys.modules))
"""


def test_status_of_one_set_imports_that_sets_codemods_only(tmp_path: Path) -> None:
    from rl_msprobe.codemods.base import Codemod
    from rl_msprobe.patches import ROWS, get_set
    from tests.support.trees import release_subset

    engine = get_set("verl-engine")
    tree = release_subset("verl", "0.9.1", tmp_path / "verl", [p.path for p in engine.all_pieces()])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", STATUS_IMPORTS, str(tree)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    modules_line, matchers_line = proc.stdout.strip().splitlines()[-2:]
    modules = set(json.loads(modules_line))
    own = {type(p.item).__module__ for p in engine.all_pieces() if isinstance(p.item, Codemod)}
    assert own <= modules
    assert {m for m in modules if m.startswith("rl_msprobe.codemods.")} - own <= {
        "rl_msprobe.codemods.base"
    }, modules
    other_set_modules = {f"rl_msprobe.patches.{row.module}" for row in ROWS if row.module != "verl"}
    assert not modules & other_set_modules, modules
    assert json.loads(matchers_line) is False  # verl-engine's anchors need no libcst.matchers


CHECK_IMPORTS = """
import json, sys
from rl_msprobe import planner
report = planner.check("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm\\n", "/tmp/run_x.sh",
                       mode="consistency")
print(json.dumps([report.patch_commands, sorted(m for m in sys.modules if m.startswith("rl_msprobe.patches."))]))
"""


def test_the_planners_patch_commands_read_the_rows_only() -> None:
    from rl_msprobe.patches import ROWS

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    commands, modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any(c.startswith("rl-msprobe patch apply verl-consistency ") for c in commands), commands
    assert not set(modules) & {f"rl_msprobe.patches.{row.module}" for row in ROWS}, modules

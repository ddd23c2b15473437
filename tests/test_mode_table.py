"""The mode table (rl_msprobe/mode_table.py) is the only list of modes: no other module spells
them out, the docs' table is its output, and a row added to it reaches detect, the planner, the CLI's
--mode choices and the docs table without another edit."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from rl_msprobe import mode_table as registry

ROOT = Path(__file__).resolve().parents[1]


def _string_groups(path: Path) -> list[tuple[int, set[str]]]:
    """(line, the string constants) of every tuple, list, set and dict literal in a module."""
    groups = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        groups.append(
            (
                node.lineno,
                {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)},
            )
        )
    return groups


def test_no_module_but_the_registry_lists_the_modes() -> None:
    names = set(registry.mode_names())
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "rl_msprobe").rglob("*.py"))
        if path.name != "registry.py" and "files" not in path.parts
        for line, strings in _string_groups(path)
        if len(strings & names) >= 3
    ]
    assert found == []


def test_the_docs_table_is_the_registrys() -> None:
    text = (ROOT / "docs" / "commands" / "prepare.md").read_text()
    assert registry.docs_table() in text
    glossary = (ROOT / "docs" / "glossary.md").read_text()  # its Mode and Derived script entries
    for mode in registry.MODES:
        assert f"`{mode.name}`" in glossary and f"`{mode.derived_prefix}<name>.sh`" in glossary, mode.name


def test_every_row_names_a_rules_module_and_unique_outputs() -> None:
    assert len(set(registry.mode_names())) == len(registry.MODES)
    assert len({m.derived_prefix for m in registry.MODES}) == len(registry.MODES)
    for mode in registry.MODES:
        assert callable(mode.rules().requirements), mode.name


NEW_ROW = """
import json, sys
from click.testing import CliRunner
from rl_msprobe import mode_table as registry
registry.MODES = (*registry.MODES, registry.Mode(
    "probe", "a test row", "training", "run_probe_", hints=((r"probe\\s+words", "probe words"),),
    hint_rank=-1, configs=("config.json",)))
from rl_msprobe import planner
from rl_msprobe.cli import main
from rl_msprobe.planner.planning import derived_name
_, detection = planner.detect_text(sys.argv[1], "/tmp/run_x.sh", hint="collect the probe words")
help_text = CliRunner().invoke(main, ["check", "--help"]).output
print(json.dumps({
    "detected": detection.mode,
    "check_choice": "probe" in help_text.split("--mode", 1)[1].split("]", 1)[0],
    "checked_mode": planner.check(sys.argv[1], "/tmp/run_x.sh", mode="probe").mode,
    "derived": derived_name("/tmp/run_x.sh", "probe"),
    "docs": "| probe | `run_probe_<name>.sh` | `config.json` |" in registry.docs_table(),
}))
"""


def test_a_new_row_reaches_detect_the_planner_the_cli_and_the_docs() -> None:
    script = "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", NEW_ROW, script], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "detected": "probe",
        "check_choice": True,
        "checked_mode": "probe",
        "derived": "run_probe_x.sh",
        "docs": True,
    }


def test_a_mode_that_asks_for_a_set_its_row_does_not_list_fails_loudly(monkeypatch) -> None:
    """The row's `patch_sets` is what the docs and `--help` say a mode may patch: rules that ask
    for another set are a bug of rl-msprobe, caught at plan time, never a plan that quietly differs."""
    import dataclasses

    import pytest

    from rl_msprobe import planner

    script = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm trainer.n_gpus_per_node=1\n"
    )
    assert any(
        "vllm-dump" in c for c in planner.check(script, "/tmp/run_x.sh", mode="inference").patch_commands
    )
    rows = tuple(
        dataclasses.replace(m, patch_sets=()) if m.name == "inference" else m for m in registry.MODES
    )
    monkeypatch.setattr(registry, "MODES", rows)
    with pytest.raises(RuntimeError, match=r"mode inference's rules ask for patch set\(s\) \['vllm-dump'\]"):
        planner.check(script, "/tmp/run_x.sh", mode="inference")

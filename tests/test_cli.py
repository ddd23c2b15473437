"""The command line shell: lazy sub-commands, exit codes, `patch list`."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.trees import run_cli


def test_help_imports_neither_libcst_nor_git():
    probe = (
        "import sys\nfrom rl_msprobe.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED=' + ','.join(m for m in ('libcst', 'git', 'unidiff') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "patch" in proc.stdout and "dumps" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED=", proc.stdout.splitlines()[-1]


def test_every_listed_command_loads():
    from rl_msprobe.cli import COMMANDS

    for name in COMMANDS:
        code, out, _ = run_cli(name, "--help")
        assert code == 0 and "Usage:" in out, name


def test_patch_list_json_names_verl_engine():
    code, out, _ = run_cli("patch", "list", "--json")
    assert code == 0
    sets = {s["name"]: s for s in json.loads(out)}
    engine = sets["verl-engine"]
    assert engine["project"] == "verl" and engine["versions"] == "0.6.0 … 0.9.1"
    assert {p["path"] for p in engine["pieces"]} >= {
        "verl/utils/rl_msprobe_hooks.py",
        "verl/workers/engine/fsdp/transformer_impl.py",
        "verl/workers/engine/megatron/transformer_impl.py",
    }


def test_status_without_set_covers_every_base_set_of_the_project():
    code, out, _ = run_cli("patch", "status", "--tree", "release:verl==0.9.1", "--json")
    names = [s["name"] for s in json.loads(out)["sets"]]
    assert code == 1 and "verl-engine" in names and "verl-consistency" not in names
    code, _, err = run_cli("patch", "status", "--python", "python3")
    assert code == 2 and "--tree" in err

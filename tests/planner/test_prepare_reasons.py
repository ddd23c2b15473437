"""`prepare` names, for every value it changes, the rule and the reason, in the words `check` uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.planner.api import changes_heading

from .conftest import CORPUS

FIXTURE = "run_qwen2_7b_grpo_fsdp_vllm.sh"


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout


def _changed_lines(diff: str) -> list[str]:
    """The derived script's added lines that set something (not comments, not re-wrapped lines)."""
    removed = {line[1:].rstrip(" \\") for line in diff.splitlines() if line.startswith("-")}
    return [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+")
        and not line.startswith("+++")
        and not line[1:].lstrip().startswith("#")
        and "=" in line
        and line[1:].rstrip(" \\") not in removed
    ]


@pytest.mark.parametrize("mode", ["training", "inference", "consistency"])
def test_every_change_has_its_rule_and_the_reason_check_gives(mode: str, tmp_path: Path) -> None:
    script = tmp_path / FIXTURE
    script.write_bytes((CORPUS / FIXTURE).read_bytes())
    code, out = _run("check", str(script), "--mode", mode, "--json")
    assert code == 1
    violations = json.loads(out)["violations"]

    code, out = _run("prepare", str(script), "--mode", mode, "--json")
    assert code == 0, out
    doc = json.loads(out)
    changes = {c["key"]: c for c in doc["changes"]}
    assert changes and all(c["rule"] and c["why"] and c["found"] != c["required"] for c in changes.values())
    # every violation check finds on the original is a change, under the same rule, for the same reason
    for v in violations:
        change = changes.get(v["key"])
        assert change is not None, v
        assert change["rule"] == v["rule"] and f"({change['why']})" in v["fix"], (change, v)
    # every line the derived script adds names a key or variable that has a change
    for line in _changed_lines(doc["diff"]):
        assert any(re.search(rf"(?:^|[\s'\"+]|env_vars\.){re.escape(key)}=", line) for key in changes), line

    # the text output says the same, one line per change
    for path in tmp_path.iterdir():
        if path.name != FIXTURE:
            path.unlink() if path.is_file() else None
    code, text = _run("prepare", str(script), "--mode", mode)
    assert code == 0, text
    listed = text.split(f"{changes_heading(mode)}:\n", 1)[1].split("\nwrote ", 1)[0]
    lines = listed.splitlines()
    assert len(lines) == len(changes)
    for line, change in zip(lines, doc["changes"], strict=True):
        assert line == (
            f"  - [{change['rule']}] {change['key']}: {change['found']} -> {change['required']} ({change['why']})"
        )


def test_consistency_names_the_values_a_newcomer_asks_about(tmp_path: Path) -> None:
    """The three surprises of a first run of the original skill's plan (--batch-one): rollout TP 2 -> 8,
    rollout.n 5 -> 8, batch sizes -> 1."""
    script = tmp_path / FIXTURE
    script.write_bytes((CORPUS / FIXTURE).read_bytes())
    code, out = _run("prepare", str(script), "--mode", "consistency", "--batch-one", "--json")
    assert code == 0, out
    changes = {c["key"]: c for c in json.loads(out)["changes"]}
    tp = changes["actor_rollout_ref.rollout.tensor_model_parallel_size"]
    assert (tp["found"], tp["required"]) == ("2", "8") and "rollout devices" in tp["why"]
    n = changes["actor_rollout_ref.rollout.n"]
    assert (n["found"], n["required"]) == ("5", "8") and "DP" in n["why"]
    batch = [c for k, c in changes.items() if "batch_size" in k]
    assert len(batch) >= 4 and {c["required"] for c in batch} == {"1"}
    # the default plan keeps them all: the job the user runs is the job that is dumped
    again = tmp_path / "default"
    again.mkdir()
    script = again / FIXTURE
    script.write_bytes((CORPUS / FIXTURE).read_bytes())
    code, out = _run("prepare", str(script), "--mode", "consistency", "--json")
    assert code == 0, out
    kept = {c["key"] for c in json.loads(out)["changes"]}
    assert not kept & {"actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.n"}
    assert not [k for k in kept if "batch_size" in k or "max_num_seqs" in k]

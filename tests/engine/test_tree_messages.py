"""`status`, `revert` and entry-point coverage speak of what the tree has (issue 33, item 4).

A file the tree lacks is "not in this tree", never a capability "found" in it; a revert, which
searches no anchor, never says "all anchors found"; an entry point whose main module the tree lacks
(verl 0.9.1 has no `main_ppo_sync.py`) is "not in this tree", never "NOT covered". Real releases
from the package index, copied into scratch trees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_msprobe.upstream import detect_version
from tests.support.trees import git, run_cli, scratch_copy

pytestmark = pytest.mark.release

MEGATRON = "verl/workers/engine/megatron/transformer_impl.py"


def test_status_never_finds_a_capability_in_a_missing_file(tmp_path: Path) -> None:
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    original = (tree / MEGATRON).read_bytes()
    (tree / MEGATRON).unlink()
    code, out, err = run_cli("patch", "status", "verl-engine", "--tree", str(tree))
    assert code == 2, out
    assert "capability found: Megatron engine hook" not in out
    assert "capability 'Megatron engine hook'" in err and "has no patched site" in err
    assert f"{MEGATRON}: not in this tree (verl-megatron-engine patches it; detected version 0.9.1)" in err
    (tree / MEGATRON).write_bytes(original)  # the file back: the same capability is found there
    code, out, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree))
    assert code == 1 and "capability found: Megatron engine hook (" + MEGATRON + ")" in out


def test_revert_on_an_untested_release_does_not_speak_of_anchors(tmp_path: Path) -> None:
    tree = scratch_copy("vllm", "0.34.0", tmp_path / "vllm", with_git=False)
    version = tree / "vllm" / "_version.py"  # a build newer than any tested release
    version.write_text(
        version.read_text().replace("'0.34.0'", "'0.35.0.dev1'").replace('"0.34.0"', '"0.35.0.dev1"')
    )
    assert detect_version(tree, "vllm") == "0.35.0.dev1"
    code, out, err = run_cli("patch", "revert", "vllm-dump", "--tree", str(tree), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["noop"] is True and doc["tested"] is False
    (warning,) = doc["warnings"]
    assert "newer than the newest tested release" in warning
    assert "anchors" not in warning and "removes only the marked lines" in warning


def test_an_entry_point_the_tree_lacks_is_not_in_this_tree(tmp_path: Path) -> None:
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl")
    assert not (tree / "verl/trainer/main_ppo_sync.py").exists()
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(tree))
    assert "main_ppo_sync (NOT covered)" not in out and "NOT COVERED" not in out
    assert "entry points: main_ppo (covered), one_step_off (covered), fully_async (covered)" in out
    assert "entry points not in this tree: main_ppo_sync" in out
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["not_in_tree"] == ["main_ppo_sync"] and doc["not_covered"] == []
    code, out, err = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    (entry,) = json.loads(out)["sets"]
    assert entry["not_in_tree"] == ["main_ppo_sync"] and entry["entry_points"]["main_ppo"] is True
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree))
    assert "already applied" in out and "NOT covered" not in out and "not covered" not in err
    assert "entry points not in this tree: main_ppo_sync" in out
    # --for the absent entry point is still refused, saying the tree lacks it
    run_cli("patch", "revert", "verl-consistency", "--tree", str(tree))
    code, _, err = run_cli(
        "patch", "apply", "verl-consistency", "--for", "main_ppo_sync", "--tree", str(tree)
    )
    assert code == 2 and "not in this tree" in err
    assert git(tree, "status", "--porcelain") == ""


def test_an_entry_point_the_tree_has_is_listed_as_covered(tmp_path: Path) -> None:
    """verl 0.8.0 ships main_ppo_sync.py: there it is covered, and nothing is "not in this tree"."""
    tree = scratch_copy("verl", "0.8.0", tmp_path / "verl", with_git=False)
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    (entry,) = json.loads(out)["sets"]
    assert entry["not_in_tree"] == [] and entry["entry_points"]["main_ppo_sync"] is True

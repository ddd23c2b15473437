"""verl-engine on every real verl release with engine files, fetched from the package index (cached)."""

from __future__ import annotations

import json

import pytest

from tests.support.releases import supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy, snapshot

VERSIONS = supported("verl-engine")  # its range in the registry, up to the newest tested verl
ENGINE_FILES = {
    "verl/utils/rl_msprobe_hooks.py",
    "verl/utils/rl_msprobe_records.py",
    "verl/workers/engine/fsdp/transformer_impl.py",
    "verl/workers/engine/megatron/transformer_impl.py",
}

pytestmark = pytest.mark.release


@pytest.mark.parametrize("version", newest_in_default(VERSIONS))
def test_full_cycle(version, tmp_path):
    tree = scratch_copy("verl", version, tmp_path / f"verl-{version}")
    status = full_cycle(tree, ["verl-engine"])
    (entry,) = status["sets"]
    assert status["version"] == version
    assert entry["status"] == "applied"
    assert {f["path"] for f in entry["files"]} == ENGINE_FILES
    assert all(f["status"] == "applied" for f in entry["files"])


@pytest.mark.parametrize("version", newest_in_default([VERSIONS[0], VERSIONS[-1]]))
def test_diff_on_fetched_release_touches_both_engines(version):
    code, out, _ = run_cli(
        "patch", "diff", "verl-engine", "--tree", f"release:verl=={version}", "--json", "--exit-code"
    )
    assert code == 1
    doc = json.loads(out)
    assert {f["path"] for f in doc["summary"]["files"]} == ENGINE_FILES
    assert doc["summary"]["removed"] == 0 and doc["summary"]["added"] >= 10


def test_non_git_tree_keeps_originals_and_reverts_exactly(tmp_path):
    tree = scratch_copy("verl", "0.8.0", tmp_path / "verl", with_git=False)
    before = snapshot(tree)
    code, out, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["git"] is None
    manifest = json.loads((tree / ".rl-msprobe" / "manifest.json").read_text())
    assert set(manifest["files"]) == ENGINE_FILES
    assert (
        tree / ".rl-msprobe" / "originals" / "verl/workers/engine/fsdp/transformer_impl.py"
    ).read_bytes() == before["verl/workers/engine/fsdp/transformer_impl.py"]
    code, _, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree))
    assert code == 0
    code, _, err = run_cli("patch", "revert", "verl-engine", "--tree", str(tree))
    assert code == 0, err
    assert snapshot(tree) == before
    assert not (tree / ".rl-msprobe").exists()


def test_default_tree_is_newest_release():
    """The README's main job: exit 0 like `git diff`, the diff on stdout, the summary on stderr."""
    code, out, err = run_cli("patch", "diff", "verl-engine")
    assert code == 0, err
    assert "verl 0.9.1" in err
    assert "+from verl.utils import rl_msprobe_hooks" in out

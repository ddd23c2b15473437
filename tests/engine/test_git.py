"""Messages that say what happened, on real verl 0.9.1 trees: a SHA-256 repository is not "no commits
yet", and a file a sparse checkout leaves out is not a file upstream lacks (issue 34, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trees import git, run_cli, scratch_copy, snapshot

pytestmark = pytest.mark.release

FSDP = "verl/workers/engine/fsdp/transformer_impl.py"


def _repo(path: Path, *init: str) -> Path:
    tree = scratch_copy("verl", "0.9.1", path, with_git=False)
    git(tree, "init", "-q", "-b", "main", *init)
    git(tree, "add", "-A")
    git(tree, "-c", "user.email=t@rl-msprobe", "-c", "user.name=t", "commit", "-q", "-m", "upstream")
    return tree


def test_a_sha256_repository_is_named_as_one(tmp_path: Path) -> None:
    tree = _repo(tmp_path / "verl", "--object-format=sha256")
    before, head = snapshot(tree), git(tree, "rev-parse", "HEAD")
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree))
    assert code == 2 and "sha256 object format" in err and "no commits yet" not in err, err
    assert snapshot(tree) == before and git(tree, "rev-parse", "HEAD") == head
    assert git(tree, "status", "--porcelain") == ""


@pytest.mark.parametrize("command", ["apply", "status", "diff"])
def test_a_file_a_sparse_checkout_leaves_out_is_named_not_called_upstream_drift(
    tmp_path: Path, command
) -> None:
    tree = _repo(tmp_path / "verl")
    git(tree, "sparse-checkout", "set", "--no-cone", "/*", "!verl/workers/engine/")
    assert not (tree / FSDP).exists()
    before = snapshot(tree)
    code, out, err = run_cli("patch", command, "verl-consistency", "--tree", str(tree))
    assert code == 2, (out, err)
    assert "sparse checkout" in err and "verl/workers/engine/" in err, err
    assert "Is --tree the folder" not in err and "is not in this tree" not in err
    assert snapshot(tree) == before

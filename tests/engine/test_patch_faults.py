"""Bad input, full disks and user edits around `patch apply` / `patch revert`: exit 2, nothing lost.

Trees: the verl-engine files of the real verl 0.9.1 release (git repos in tmp dirs, or plain folders).
A full disk cannot be made here without root's mount rights, so it is simulated by the test-only
hook (RL_MSPROBE_FAULT=enospc raises "No space left on device" at a named step and every later one,
the rollback included).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.trees import git, init_repo, release_subset, run_cli, tree_state

pytestmark = pytest.mark.release
SET = "verl-engine"
HELPER = "verl/utils/rl_msprobe_hooks.py"
FSDP = "verl/workers/engine/fsdp/transformer_impl.py"
MEGATRON = "verl/workers/engine/megatron/transformer_impl.py"
RECORDS = "verl/utils/rl_msprobe_records.py"  # the per-token recorder the set adds beside the helper
PATHS = [HELPER, RECORDS, FSDP, MEGATRON]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return release_subset("verl", "0.9.1", tmp_path / "verl", PATHS)


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    return release_subset("verl", "0.9.1", tmp_path / "site", PATHS, with_git=False)


def apply(tree: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("patch", "apply", SET, "--tree", str(tree), *extra)


def revert(tree: Path) -> tuple[int, str, str]:
    return run_cli("patch", "revert", SET, "--tree", str(tree))


def refused(tree: Path, *words: str, args: tuple[str, ...] = ()) -> None:
    """apply exits 2 naming `words`, and the tree (files, branches, HEAD, index) is exactly as before."""
    before = tree_state(tree)
    code, _, err = apply(tree, *args)
    assert code == 2, err
    assert "Traceback" not in err and all(w in err for w in words), err
    assert tree_state(tree) == before


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", ["repo", "plain"])
def test_byte_order_mark_exit_2(kind: str, request) -> None:
    tree = request.getfixturevalue(kind)
    path = tree / FSDP
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    if kind == "repo":
        git(tree, "commit", "-qam", "bom")
    refused(tree, FSDP, "byte-order mark")


def test_cr_only_line_endings_exit_2(repo: Path) -> None:
    path = repo / MEGATRON
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))
    git(repo, "commit", "-qam", "old mac")
    refused(repo, MEGATRON + ":1", "carriage return")


def test_unreadable_file_exit_2(plain: Path) -> None:
    (plain / MEGATRON).unlink()
    (plain / MEGATRON).symlink_to("/proc/self/mem")  # read fails (EIO) even for root
    refused(plain, MEGATRON, "cannot be read")


def test_symlink_out_of_the_repo_refused_before_the_branch(repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.py"
    shutil.copy(repo / FSDP, outside)
    (repo / FSDP).unlink()
    (repo / FSDP).symlink_to(outside)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "link")
    before = outside.read_bytes()
    refused(repo, FSDP, "outside the git repository")
    assert outside.read_bytes() == before


@pytest.mark.parametrize("name", ["bad..name", "-x", "a b", "x.lock"])
def test_invalid_branch_exit_2(repo: Path, name: str) -> None:
    refused(repo, "--branch", args=("--branch", name))


def test_repo_without_commits_exit_2(tmp_path: Path) -> None:
    tree = release_subset("verl", "0.9.1", tmp_path / "verl", PATHS, with_git=False)
    git(tree, "init", "-q")
    refused(tree, "no commits")


@pytest.mark.parametrize("manifest", ["[]", '{"files": []}', '{"files": {"x": 3}}', "{"])
def test_manifest_of_the_wrong_shape_exit_2(plain: Path, manifest: str) -> None:
    (plain / ".rl-msprobe").mkdir()
    (plain / ".rl-msprobe" / "manifest.json").write_text(manifest)
    refused(plain, "manifest")
    before = tree_state(plain)
    code, _, err = revert(plain)
    assert code in (0, 2) and "Traceback" not in err and tree_state(plain) == before


@pytest.mark.parametrize("python", ["python3 'x", "/etc/hostname", ""])
def test_bad_python_exit_2(python: str) -> None:
    code, _, err = run_cli("patch", "apply", SET, "--python", python)
    assert code == 2 and "--python" in err, err


# ---------------------------------------------------------------- full disk, read-only state


def test_read_only_state_folder_changes_nothing(plain: Path) -> None:
    state = plain / ".rl-msprobe"
    state.mkdir()
    state.chmod(0o555)
    try:
        refused(plain, str(state), "read-only")
    finally:
        state.chmod(0o755)


@pytest.mark.parametrize("kind", ["repo", "plain"])
def test_full_disk_while_recording_changes_nothing(kind: str, request, monkeypatch) -> None:
    tree = request.getfixturevalue(kind)
    monkeypatch.setenv("RL_MSPROBE_FAULT", "enospc")
    monkeypatch.setenv("RL_MSPROBE_FAULT_AT", "journal-write")
    refused(tree, "No space left on device", "Nothing was changed")


@pytest.mark.parametrize("kind", ["repo", "plain"])
def test_full_disk_mid_apply_and_in_its_rollback(kind: str, request, monkeypatch) -> None:
    tree = request.getfixturevalue(kind)
    before = tree_state(tree)
    monkeypatch.setenv("RL_MSPROBE_FAULT", "enospc")
    monkeypatch.setenv("RL_MSPROBE_FAULT_AT", f"write:{FSDP}")
    code, _, err = apply(tree)
    assert code == 2 and "No space left on device" in err and "Traceback" not in err
    assert "undoing it failed too" in err and "next rl-msprobe command" in err
    monkeypatch.delenv("RL_MSPROBE_FAULT_AT")  # space again: the next command finishes the undo
    code, out, _ = run_cli("patch", "status", SET, "--tree", str(tree), "--json")
    assert code == 1 and json.loads(out)["journal"]["outcome"] == "rolled back"
    assert tree_state(tree) == before


def test_full_disk_mid_apply_rolled_back_at_once(repo: Path, monkeypatch) -> None:
    before = tree_state(repo)
    monkeypatch.setenv("RL_MSPROBE_FAULT", "enospc")
    monkeypatch.setenv("RL_MSPROBE_FAULT_AT", f"write:{MEGATRON}")
    monkeypatch.setattr("rl_msprobe.engine.journal.checkpoint", _fault_once)
    code, _, err = apply(repo)
    assert code == 2 and "every file was restored" in err
    assert tree_state(repo) == before


def _fault_once(step: str) -> None:
    if step == os.environ.get("RL_MSPROBE_FAULT_AT"):
        raise OSError(28, "No space left on device", step)


# ---------------------------------------------------------------- revert keeps the user's bytes


def test_git_revert_refuses_uncommitted_edits_in_its_files(repo: Path) -> None:
    assert apply(repo)[0] == 0
    (repo / FSDP).write_text((repo / FSDP).read_text() + "# my edit\n")
    before = tree_state(repo)
    code, _, err = revert(repo)
    assert code == 2 and FSDP in err and "uncommitted" in err
    assert tree_state(repo) == before


def test_git_revert_commits_only_its_files(repo: Path) -> None:
    assert apply(repo)[0] == 0
    init = repo / "verl" / "__init__.py"
    init.write_text(init.read_text() + "# mine, not committed\n")
    code, _, err = revert(repo)
    assert code == 0, err
    assert sorted(git(repo, "show", "--name-only", "--format=", "HEAD").split()) == sorted(PATHS)
    assert git(repo, "status", "--porcelain").strip() == "M verl/__init__.py"


def test_git_revert_after_the_helper_was_deleted_covers_the_whole_set(repo: Path) -> None:
    original = tree_state(repo)
    assert apply(repo)[0] == 0
    (repo / HELPER).unlink()
    code, out, err = run_cli("patch", "revert", SET, "--tree", str(repo), "--json")
    assert code == 0, err
    assert sorted(json.loads(out)["changed"]) == sorted(PATHS)
    assert sorted(git(repo, "show", "--name-only", "--format=", "HEAD").split()) == sorted(PATHS)
    assert git(repo, "status", "--porcelain") == ""
    state = tree_state(repo)
    assert {k: v for k, v in state.items() if not k.startswith("git:")} == {
        k: v for k, v in original.items() if not k.startswith("git:")
    }
    assert state["git:tree"] == original["git:tree"]


def test_plain_revert_keeps_symlinks(plain: Path) -> None:
    real = plain / "verl" / "workers" / "engine" / "fsdp" / "real_impl.py"
    (plain / FSDP).rename(real)
    (plain / FSDP).symlink_to(real.name)
    before = tree_state(plain)
    assert apply(plain)[0] == 0
    assert (plain / FSDP).is_symlink() and "rl-msprobe" in real.read_text()
    assert revert(plain)[0] == 0
    assert (plain / FSDP).is_symlink()
    assert tree_state(plain) == before


# ---------------------------------------------------------------- a tree ignored by an enclosing repo


def test_tree_ignored_by_the_enclosing_repo_is_patched_without_git(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / ".gitignore").write_text(".venv/\n")
    (project / "train.py").write_text("print('hi')\n")
    init_repo(project)
    site = project / ".venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    release_subset("verl", "0.9.1", site, PATHS, with_git=False)
    before = tree_state(site)
    head = git(project, "rev-parse", "HEAD")
    code, out, err = run_cli("patch", "apply", SET, "--tree", str(site), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["git"] is None and any("ignored by the git repository" in n for n in doc["notes"])
    assert (site / ".rl-msprobe" / "manifest.json").is_file()
    assert git(project, "rev-parse", "HEAD") == head and git(project, "status", "--porcelain") == ""
    assert run_cli("patch", "status", SET, "--tree", str(site))[0] == 0
    assert revert(site)[0] == 0
    assert tree_state(site) == before


def test_tree_folder_not_writable_keeps_its_state_in_the_user_cache(
    plain: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("RL_MSPROBE_CACHE", str(tmp_path / "cache"))
    before = tree_state(plain)
    plain.chmod(0o555)  # the package folders stay writable; the folder holding them does not
    try:
        code, out, err = run_cli("patch", "apply", SET, "--tree", str(plain), "--json")
        assert code == 0, err
        manifest = Path(json.loads(out)["manifest"])
        assert manifest.is_file() and manifest.is_relative_to(tmp_path / "cache")
        assert not (plain / ".rl-msprobe").exists()
        assert revert(plain)[0] == 0
    finally:
        plain.chmod(0o755)
    assert tree_state(plain) == before and not manifest.exists()

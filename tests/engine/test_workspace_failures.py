"""What goes wrong, and that nothing is half-written when it does."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from tests.support.trees import git, init_repo, run_cli, scratch_copy, snapshot

FSDP = "verl/workers/engine/fsdp/transformer_impl.py"
MEGATRON = "verl/workers/engine/megatron/transformer_impl.py"


@pytest.fixture
def tree(tmp_path):
    return scratch_copy("verl", "0.9.1", tmp_path / "verl")


def test_drifted_tree_exit_2_names_file_and_writes_nothing(tree):
    path = tree / MEGATRON
    path.write_text(path.read_text().replace("output = forward_fn(", "output = run_model_forward("))
    git(tree, "commit", "-qam", "drift")
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    assert code == 2
    assert MEGATRON in err and "forward_fn call" in err and "0.9.1" in err
    assert snapshot(tree) == before
    assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"


def test_dirty_git_tree_refused_and_change_kept(tree):
    readme = tree / "verl" / "__init__.py"
    readme.write_text(readme.read_text() + "\n# my local edit\n")
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    assert code == 2 and "uncommitted" in err and "--allow-dirty" in err
    assert readme.read_text().endswith("# my local edit\n")
    assert (tree / FSDP).read_text().count("rl-msprobe") == 0


def test_allow_dirty_leaves_user_changes_out_of_the_commit(tree):
    init = tree / "verl" / "__init__.py"
    init.write_text(init.read_text() + "\n# my local edit\n")
    code, out, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree), "--allow-dirty", "--json")
    assert code == 0, err
    assert init.read_text().endswith("# my local edit\n")
    committed = git(tree, "show", "--name-only", "--format=", "HEAD").split()
    assert "verl/__init__.py" not in committed and FSDP in committed
    assert git(tree, "status", "--porcelain").strip() == "M verl/__init__.py"


def test_allow_dirty_refuses_when_the_patched_file_itself_is_dirty(tree):
    path = tree / FSDP
    path.write_text(path.read_text() + "\n# mine\n")
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree), "--allow-dirty")
    assert code == 2 and FSDP in err
    assert path.read_text().endswith("# mine\n") and "rl-msprobe" not in path.read_text()


def test_version_number_alone_refuses_nothing(tree):
    """0.9.1 code labelled 0.5.0: the anchors are found, so it is patched, with a warning."""
    (tree / "verl" / "version" / "version").write_text("0.5.0")
    git(tree, "commit", "-qam", "pretend 0.5.0")
    code, out, err = run_cli("patch", "diff", "verl-engine", "--tree", str(tree), "--json", "--exit-code")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["tested"] is False and "older than the oldest tested release 0.6.0" in doc["warnings"][0]


def test_missing_engine_file_is_refused_naming_it(tree):
    (tree / MEGATRON).unlink()
    git(tree, "commit", "-qam", "no megatron")
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    assert code == 2 and MEGATRON in err and "missing" in err and "verl-megatron-engine" in err
    assert snapshot(tree) == before


def test_tree_that_is_not_verl(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "setup.py").write_text("")
    code, _, err = run_cli("patch", "diff", "verl-engine", "--tree", str(tmp_path / "project"))
    assert code == 2 and "not a verl tree" in err and "verl/__init__.py" in err


def test_package_folder_itself_is_accepted(tree):
    code, out, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree / "verl"), "--json")
    assert code == 1 and json.loads(out)["tree"] == str(tree)


def test_crlf_file_keeps_line_endings_through_apply_and_revert(tree):
    path = tree / FSDP
    crlf = path.read_bytes().replace(b"\n", b"\r\n")
    path.write_bytes(crlf)
    git(tree, "commit", "-qam", "crlf")
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    assert code == 0, err
    patched = path.read_bytes()
    assert b"rl-msprobe:verl-fsdp-engine\r\n" in patched
    assert patched.count(b"\n") == patched.count(b"\r\n")
    code, _, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree))
    assert code == 0
    code, _, _ = run_cli("patch", "revert", "verl-engine", "--tree", str(tree))
    assert code == 0 and path.read_bytes() == crlf


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_read_only_file_nothing_half_written(tree):
    before = snapshot(tree)
    path = tree / MEGATRON
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP)
    try:
        code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    finally:
        os.chmod(path, 0o644)
    assert code == 2 and MEGATRON in err and "read-only" in err
    assert snapshot(tree) == before
    assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"


def test_fetched_release_is_read_only():
    code, _, err = run_cli("patch", "apply", "verl-engine", "--tree", "release:verl==0.9.1")
    assert code == 2 and "read-only" in err


def test_partial_and_conflict_status(tree):
    code, _, _ = run_cli("patch", "apply", "verl-engine", "--tree", str(tree))
    assert code == 0
    # one file of the set reverted by hand: the set is partial
    git(tree, "checkout", "main", "--", FSDP)
    code, out, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["sets"][0]["status"] == "partial"
    by_path = {f["path"]: f["status"] for f in doc["sets"][0]["files"]}
    assert by_path[FSDP] == "absent" and by_path[MEGATRON] == "applied"
    # an anchor changed after apply: conflict
    path = tree / MEGATRON
    path.write_text(path.read_text().replace("def forward_backward_batch", "def run_batches"))
    code, out, _ = run_cli("patch", "status", "verl-engine", "--tree", str(tree), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["sets"][0]["status"] == "conflict"
    assert "MegatronEngine.forward_backward_batch" in json.dumps(doc)


def test_branch_name_and_no_branch(tree):
    code, out, _ = run_cli(
        "patch", "apply", "verl-engine", "--tree", str(tree), "--branch", "dump/try1", "--json"
    )
    assert code == 0 and json.loads(out)["git"]["branch"] == "dump/try1"
    code, _, _ = run_cli("patch", "revert", "verl-engine", "--tree", str(tree))
    git(tree, "checkout", "-q", "main")
    code, out, _ = run_cli("patch", "apply", "verl-engine", "--tree", str(tree), "--no-branch", "--json")
    assert code == 0 and json.loads(out)["git"]["branch"] == "main"
    assert "rl-msprobe: apply verl-engine" in git(tree, "log", "-1", "--format=%s")


def test_python_target_finds_tree_without_importing(tmp_path):
    tree = scratch_copy("verl", "0.9.1", tmp_path / "site", with_git=False)
    (tree / "verl" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    py = f"env PYTHONPATH={tree} {sys.executable}"
    code, out, err = run_cli("patch", "status", "verl-engine", "--python", py, "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["tree"] == str(tree) and doc["version"] == "0.9.1"


def test_unknown_set_and_missing_tree():
    code, _, err = run_cli("patch", "diff", "no-such-set")
    assert code == 2 and "verl-engine" in err
    code, _, err = run_cli("patch", "status", "verl-engine", "--tree", "/nonexistent/verl")
    assert code == 2 and "no such folder" in err


def test_init_repo_helper_makes_clean_repo(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("x = 1\n")
    init_repo(tmp_path / "a")
    assert git(tmp_path / "a", "status", "--porcelain") == ""


@pytest.mark.parametrize(("version", "expect_note"), [("0.7.1", True), ("0.9.1", False)])
def test_legacy_worker_note_only_where_it_holds(tmp_path, version, expect_note):
    tree = scratch_copy("verl", version, tmp_path / "verl")
    code, out, err = run_cli("patch", "apply", "verl-engine", "--tree", str(tree), "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("use_legacy_worker_impl=disable" in n for n in notes) is expect_note

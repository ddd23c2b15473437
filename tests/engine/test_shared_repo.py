"""The user's git is shared, journals and locks are untrusted input (issue 23, items 1-8 and 12-15).

Trees hold the verl-engine files of the real verl 0.9.1 release, as git repos and plain folders. A
run that must be interrupted is a real `rl-msprobe` process stopped at a named step by the test-only
hook (RL_MSPROBE_FAULT_AT / RL_MSPROBE_FAULT: kill = SIGKILL, int = SIGINT as Ctrl-C, pause).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.test_crash_safety import fork_cli, paused, wait
from tests.engine.test_patch_faults import FSDP, MEGATRON, PATHS, SET
from tests.support.trees import git, release_subset, run_cli, tree_state

pytestmark = pytest.mark.release
BRANCH = "rl-msprobe/verl-engine"
ROOT = Path(__file__).resolve().parents[2]
CHANGE_ID_HOOK = """#!/bin/sh
# what Gerrit's commit-msg hook does: a Change-Id trailer appended to every message
printf '\\nChange-Id: I%s\\n' "$(date +%s%N)" >> "$1"
"""


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("shared")
    out = {}
    for kind in ("git", "plain"):
        out[kind] = release_subset("verl", "0.9.1", base / kind, PATHS, with_git=kind == "git")
    applied = shutil.copytree(out["git"], base / "git-applied", symlinks=True)
    assert run_cli("patch", "apply", SET, "--tree", str(applied))[0] == 0
    out["git-applied"] = applied
    return out


def copy(originals: dict[str, Path], kind: str, dest: Path) -> Path:
    return Path(shutil.copytree(originals[kind], dest, symlinks=True))


def cli(tree: Path, op: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rl_msprobe", "patch", op, SET, "--tree", str(tree), *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=300,
        check=False,
    )


def status(tree: Path) -> dict:
    return json.loads(run_cli("patch", "status", SET, "--tree", str(tree), "--json")[1])


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip()


def clean(tree: Path) -> bool:
    """The work tree and the index match HEAD (nothing staged, nothing modified)."""
    return git(tree, "status", "--porcelain", "--untracked-files=no").strip() == ""


# ---------------------------------------------------------------- 1, 14: Ctrl-C around the commit


@pytest.mark.parametrize(
    ("op", "step"), [("apply", "ref"), ("apply", "head"), ("apply", "published"), ("revert", "ref")]
)
def test_ctrl_c_after_the_commit_finishes_the_operation_and_exits_0(originals, tmp_path, op, step):
    tree = copy(originals, "git" if op == "apply" else "git-applied", tmp_path / "t")
    proc = cli(tree, op, {"RL_MSPROBE_FAULT_AT": step, "RL_MSPROBE_FAULT": "int"})
    assert proc.returncode == 0 and "Aborted" not in proc.stderr, proc.stderr
    assert clean(tree) and "journal" not in status(tree)
    assert status(tree)["sets"][0]["status"] == ("applied" if op == "apply" else "absent")
    assert head(tree) == BRANCH
    assert git(tree, "log", "-1", "--format=%s").startswith(f"rl-msprobe: {op}")


@pytest.mark.parametrize("op", ["apply", "revert"])
def test_ctrl_c_before_the_commit_undoes_everything_at_once(originals, tmp_path, op):
    start = "git" if op == "apply" else "git-applied"
    tree = copy(originals, start, tmp_path / "t")
    before = tree_state(tree)
    proc = cli(tree, op, {"RL_MSPROBE_FAULT_AT": f"write:{FSDP}", "RL_MSPROBE_FAULT": "int"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert tree_state(tree) == before and clean(tree) and "journal" not in status(tree)


# ---------------------------------------------------------------- 2: hooks that edit the message


def _with_hook(tree: Path) -> Path:
    hook = tree / ".git" / "hooks" / "commit-msg"
    hook.write_text(CHANGE_ID_HOOK)
    hook.chmod(0o755)
    return tree


@pytest.mark.parametrize("step", ["journal", f"write:{MEGATRON}", "index-lock", "ref", "head", "published"])
def test_a_message_editing_hook_and_a_kill_at_each_step_leave_the_tree_matching_head(
    originals, tmp_path, step
):
    tree = _with_hook(copy(originals, "git", tmp_path / "t"))
    before = tree_state(tree)
    assert wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": step})) == -9
    doc = status(tree)
    completed = step in ("ref", "head", "published")
    assert doc["journal"]["outcome"] == ("completed" if completed else "rolled back"), doc["journal"]
    assert clean(tree), git(tree, "status", "--porcelain")
    if not completed:
        assert tree_state(tree) == before
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))  # and every later command works
    assert code == 0, err
    assert clean(tree) and status(tree)["sets"][0]["status"] == "applied"


# ---------------------------------------------------------------- 3, 13: the user's own commits


@pytest.mark.parametrize("step", ["journal", f"write:{FSDP}", f"write:{MEGATRON}", "index-lock"])
def test_a_users_commit_during_an_apply_takes_only_the_users_files(originals, tmp_path, step):
    """The user commits while rl-msprobe is stopped at each step, then rl-msprobe is killed. From
    before its first write rl-msprobe holds git's index lock, so git makes the user wait."""
    tree = copy(originals, "git", tmp_path / "t")
    proc = paused("apply", tree, step)
    try:
        (tree / "NOTES.md").write_text("mine\n")
        add = subprocess.run(
            ["git", "add", "NOTES.md"], cwd=tree, capture_output=True, text=True, check=False
        )
        if step != "journal":  # rl-msprobe holds git's index lock: git itself makes the user wait
            assert add.returncode != 0 and "index.lock" in add.stderr
        else:
            git(tree, "commit", "-q", "-m", "my notes")
            assert git(tree, "show", "--name-only", "--format=", "HEAD").split() == ["NOTES.md"]
    finally:
        proc.kill()
        proc.wait()
    doc = status(tree)
    assert doc["journal"]["outcome"] == "rolled back" and doc["sets"][0]["status"] == "absent"
    assert (tree / "NOTES.md").read_text() == "mine\n"
    if step == "journal":
        assert clean(tree) and git(tree, "log", "-1", "--format=%s").strip() == "my notes"
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 0 and clean(tree), err


def test_a_commit_of_the_user_on_the_new_branch_after_a_kill_is_kept(originals, tmp_path):
    tree = copy(originals, "git", tmp_path / "t")
    step = "published"  # the branch, HEAD and index are in place, the journal not yet finished
    assert wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": step})) == -9
    assert head(tree) == BRANCH
    (tree / "NOTES.md").write_text("mine\n")
    git(tree, "add", "NOTES.md")
    git(tree, "commit", "-q", "-m", "my notes on the branch")
    doc = status(tree)
    assert doc["journal"]["outcome"] == "completed" and doc["sets"][0]["status"] == "applied"
    assert head(tree) == BRANCH and (tree / "NOTES.md").read_text() == "mine\n" and clean(tree)


# ---------------------------------------------------------------- 4: a live git's index.lock


def test_an_index_lock_of_a_running_git_is_never_removed(originals, tmp_path):
    tree = copy(originals, "git", tmp_path / "t")
    assert (
        wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": "journal"})) == -9
    )
    lock = tree / ".git" / "index.lock"
    lock.write_bytes(b"")  # held by the user's `git add` of a big file, still running:
    stand_in = tmp_path / "git"
    stand_in.symlink_to(shutil.which("sleep"))
    # started by a shell of its own, as a user's git is (this process's own git children are GitPython's)
    user_git = subprocess.Popen(["sh", "-c", f"{stand_in} 30; true"], cwd=tree, start_new_session=True)
    try:
        time.sleep(0.3)
        code, out, err = run_cli("patch", "status", SET, "--tree", str(tree), "--json")
        journal = json.loads(out).get("journal", {})
        assert journal.get("outcome") == "unfinished" and "git is running" in journal["detail"], out
        assert lock.exists()
        code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
        assert code == 2 and str(lock) in err and "git is running" in err, err
        assert lock.exists()
    finally:
        os.killpg(user_git.pid, signal.SIGKILL)
        user_git.wait()
    code, out, err = run_cli("patch", "apply", SET, "--tree", str(tree), "--json")  # its git ended: removed
    assert code == 0 and json.loads(out)["recovered"]["removed"] == str(lock), err


# ---------------------------------------------------------------- 5, 6, 7: planted journals and locks


def _planted(tree: Path, files: list[dict]) -> Path:
    folder = tree / ".rl-msprobe" / "journal"
    (folder / "blobs").mkdir(parents=True)
    data = b"planted bytes\n"
    digest = __import__("hashlib").sha256(data).hexdigest()
    (folder / "blobs" / digest).write_bytes(data)
    for item in files:
        item.setdefault("before", digest)
    doc = {"op": "apply", "pid": 1, "started": time.time(), "files": files, "git": None}
    (folder / "journal.json").write_text(json.dumps(doc))
    return folder


@pytest.mark.parametrize(
    "item",
    [
        {"path": "/tmp/OUTSIDE", "label": "x", "after": None},  # an old-style absolute path
        {"base": "tree", "path": "/tmp/OUTSIDE", "label": "x", "after": None},
        {"base": "tree", "path": "../OUTSIDE", "label": "x", "after": None},
        {"base": "tree", "path": "verl/link/OUTSIDE", "label": "x", "after": None},
    ],
    ids=["old-absolute", "absolute", "dot-dot", "through-a-link"],
)
def test_a_planted_journal_never_writes_outside_the_tree(originals, tmp_path, item):
    tree = copy(originals, "plain", tmp_path / "t")
    (tree / "verl" / "link").symlink_to(tmp_path)
    item = {**item, "path": item["path"].replace("/tmp/", f"{tmp_path}/")}
    _planted(tree, [item])
    code, out, err = run_cli("patch", "status", SET, "--tree", str(tree), "--json")
    assert "never writes outside the tree" in json.loads(out)["journal"]["detail"]
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "never writes outside the tree" in err, err
    assert not (tmp_path / "OUTSIDE").exists()


def test_a_symlinked_lock_file_leaves_its_target_alone(originals, tmp_path):
    tree = copy(originals, "plain", tmp_path / "t")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tree / ".rl-msprobe").mkdir()
    (tree / ".rl-msprobe" / "lock").symlink_to(victim)
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "symlink" in err, err
    assert victim.read_text() == "precious\n"


def test_a_state_folder_others_may_write_is_refused(originals, tmp_path):
    tree = copy(originals, "plain", tmp_path / "t")
    (tree / ".rl-msprobe").mkdir()
    (tree / ".rl-msprobe").chmod(0o777)
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "every user" in err, err


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_a_journal_blob_cut_short_is_never_restored(originals, tmp_path, kind):
    tree = copy(originals, kind, tmp_path / "t")
    assert (
        wait(
            fork_cli(
                ["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": f"write:{MEGATRON}"}
            )
        )
        == -9
    )
    state = tree / (".git/rl-msprobe" if kind == "git" else ".rl-msprobe")
    doc = json.loads((state / "journal" / "journal.json").read_text())
    item = next(i for i in doc["files"] if i["label"] == FSDP)
    blob = state / "journal" / "blobs" / item["before"]
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    patched = (tree / FSDP).read_bytes()
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and str(blob) in err and "sha256" in err, err
    assert (tree / FSDP).read_bytes() == patched  # nothing restored from the damaged copy


# ---------------------------------------------------------------- 8, 15: full and read-only disks


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_a_disk_without_room_is_refused_before_the_first_byte(originals, tmp_path, kind, monkeypatch):
    tree = copy(originals, kind, tmp_path / "t")
    before = tree_state(tree)
    monkeypatch.setattr("rl_msprobe.engine.space.free_bytes", lambda path: 1_100_000)
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "free" in err and "needs about" in err and "MiB" in err, err
    assert tree_state(tree) == before


def test_a_full_disk_on_a_plain_tree_names_the_file(originals, tmp_path, monkeypatch):
    from rl_msprobe.engine import journal

    tree = copy(originals, "plain", tmp_path / "t")
    real = journal.write_file

    def full(path, data, durable=False, step=""):
        if step == f"replace:{FSDP}":
            raise OSError(28, "No space left on device")  # as os.write raises it: no file name
        return real(path, data, durable, step)

    monkeypatch.setattr(journal, "write_file", full)
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and str(tree / FSDP) in err and "a file" not in err, err


def test_a_read_only_mount_gets_the_mount_hint_not_chmod(originals, tmp_path, monkeypatch):
    tree = copy(originals, "plain", tmp_path / "t")
    real = os.statvfs

    class ReadOnly:
        def __init__(self, info):
            self.info = info

        def __getattr__(self, name):
            return os.ST_RDONLY | self.info.f_flag if name == "f_flag" else getattr(self.info, name)

    monkeypatch.setattr(
        os, "statvfs", lambda p: ReadOnly(real(p)) if str(p).startswith(str(tree)) else real(p)
    )
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "read-only file system" in err and "chmod" not in err, err


# ---------------------------------------------------------------- 11, 12: bad input, one plain line


def test_a_repository_of_another_user_is_named_as_such(originals, tmp_path, monkeypatch):
    tree = copy(originals, "git", tmp_path / "t")
    monkeypatch.setenv("GIT_TEST_ASSUME_DIFFERENT_OWNER", "1")  # git's own switch for this check
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and "dubious ownership" in err and "safe.directory" in err and "no commits" not in err, (
        err
    )


@pytest.mark.parametrize("printed", ["1", "null", "[1]"])
def test_a_python_that_prints_something_else_is_bad_input(tmp_path, printed):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{printed}'\n")
    fake.chmod(0o755)
    code, _, err = run_cli("patch", "status", SET, "--python", str(fake))
    assert code == 2 and "unexpected output" in err and "Traceback" not in err, err


def test_a_verl_version_file_that_is_not_utf8_is_named(originals, tmp_path):
    tree = copy(originals, "plain", tmp_path / "t")
    (tree / "verl" / "version").mkdir(exist_ok=True)
    (tree / "verl" / "version" / "version").write_bytes(b"0.9.\xff\n")
    code, _, err = run_cli("patch", "status", SET, "--tree", str(tree))
    assert code == 2 and "version/version: not UTF-8" in err, err

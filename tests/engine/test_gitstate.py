"""The git states people are in (issue 34, items 1-3): the repository is always the tree's, an
operation in progress or a hidden edit is refused, and git's index lock is held from before the
first write until the commit is in.

Every tree holds the verl-engine files of the real verl 0.9.1 release in a real git repository;
each case asserts the tree (files, branches, HEAD, index, status) is exactly as before or fully
applied, the exit code and the message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rl_msprobe.engine import gitenv, journal
from tests.engine.test_patch_faults import FSDP, MEGATRON, PATHS, SET
from tests.support.trees import release_subset, run_cli, tree_state

pytestmark = pytest.mark.release
BRANCH = "rl-msprobe/verl-engine"


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("states")
    original = release_subset("verl", "0.9.1", base / "original", PATHS)
    applied = Path(shutil.copytree(original, base / "applied", symlinks=True))
    assert run_cli("patch", "apply", SET, "--tree", str(applied))[0] == 0
    return {"original": original, "applied": applied}


def copy(trees: dict[str, Path], kind: str, dest: Path) -> Path:
    return Path(shutil.copytree(trees[kind], dest, symlinks=True))


def git(cwd: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    """git in `cwd`'s own repository, whatever this process's environment says."""
    proc = subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        env={**gitenv.env(), **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)}: {proc.stderr}")
    return proc.stdout


@contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def apply(tree: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("patch", "apply", SET, "--tree", str(tree), *extra)


def one_line_error(err: str) -> str:
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- 1: the repository is the tree's


def other_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "mine.txt").write_text("the user's other project\n")
    git(path, "add", "mine.txt")
    git(path, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "other")
    return path


def everything(path: Path) -> dict[str, bytes]:
    """Every byte of a folder, .git included (a repository nothing may write into)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "variable",
    ["GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR", "GIT_NAMESPACE"],
)
def test_git_variables_in_the_environment_are_ignored(trees, tmp_path, variable):
    tree = copy(trees, "original", tmp_path / "t")
    other = other_repo(tmp_path / "other")
    value = {
        "GIT_DIR": str(other / ".git"),
        "GIT_WORK_TREE": str(other),
        "GIT_INDEX_FILE": str(other / ".git" / "index"),
        "GIT_OBJECT_DIRECTORY": str(other / ".git" / "objects"),
        "GIT_COMMON_DIR": str(other / ".git"),
        "GIT_NAMESPACE": "elsewhere",
    }[variable]
    before = everything(other)
    with environment(**{variable: value}):
        code, out, err = apply(tree, "--json")
    assert code == 0, err
    assert f"{variable}={value} in the environment: ignored" in out
    assert tree_state(tree) == tree_state(trees["applied"]), "the tree's own repository holds the commit"
    assert git(tree, "log", "-1", "--format=%s").startswith("rl-msprobe: apply verl-engine")
    assert everything(other) == before, f"{variable} named another repository: nothing of it may change"
    with environment(**{variable: value}):
        code, _, err = run_cli("patch", "revert", SET, "--tree", str(tree))
    assert code == 0, err
    assert everything(other) == before
    assert git(tree, "status", "--porcelain") == "" and git(tree, "log", "-1", "--format=%s").startswith(
        "rl-msprobe: revert"
    )


def test_all_git_location_variables_at_once_and_alternates(trees, tmp_path):
    tree = copy(trees, "original", tmp_path / "t")
    other = other_repo(tmp_path / "other")
    before = everything(other)
    values = {
        "GIT_DIR": str(other / ".git"),
        "GIT_WORK_TREE": str(other),
        "GIT_INDEX_FILE": str(tmp_path / "stray-index"),
        "GIT_OBJECT_DIRECTORY": str(tmp_path / "no-objects"),
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(other / ".git" / "objects"),
        "GIT_CEILING_DIRECTORIES": str(tree),
    }
    with environment(**values):
        code, _, err = apply(tree)
    assert code == 0, err
    assert tree_state(tree) == tree_state(trees["applied"])
    assert everything(other) == before
    assert not (tmp_path / "stray-index").exists() and not (tmp_path / "no-objects").exists()


# ---------------------------------------------------------------- 2: an operation in progress


def commit_all(tree: Path, message: str) -> None:
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", message)


def side_branch(tree: Path, text_main: str, text_side: str) -> None:
    """NOTES.md differs on `side` and on main (a conflict when one is brought onto the other)."""
    (tree / "NOTES.md").write_text("base\n")
    commit_all(tree, "notes")
    git(tree, "checkout", "-qb", "side")
    (tree / "NOTES.md").write_text(text_side)
    commit_all(tree, "side notes")
    git(tree, "checkout", "-q", "main")
    (tree / "NOTES.md").write_text(text_main)
    commit_all(tree, "main notes")


def start_rebase(tree: Path) -> None:  # stopped cleanly at an `edit`: no conflict, nothing dirty
    (tree / "NOTES.md").write_text("one\n")
    commit_all(tree, "notes 1")
    (tree / "NOTES.md").write_text("two\n")
    commit_all(tree, "notes 2")
    git(tree, "rebase", "-q", "-i", "HEAD~1", env={"GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"})


def start_conflicted_rebase(tree: Path) -> None:
    side_branch(tree, "main\n", "side\n")
    git(tree, "checkout", "-q", "side")
    assert git(tree, "rebase", "main", check=False) is not None


def start_am(tree: Path) -> None:
    side_branch(tree, "main\n", "side\n")
    patch = git(tree, "format-patch", "-1", "--stdout", "side")
    subprocess.run(
        ["git", "am", "-q"], cwd=tree, input=patch, text=True, capture_output=True, env=gitenv.env()
    )


def start_merge(tree: Path) -> None:  # a clean merge stopped before its commit
    (tree / "NOTES.md").write_text("base\n")
    commit_all(tree, "notes")
    git(tree, "checkout", "-qb", "side")
    (tree / "OTHER.md").write_text("x\n")
    commit_all(tree, "other")
    git(tree, "checkout", "-q", "main")
    (tree / "NOTES.md").write_text("main\n")
    commit_all(tree, "main notes")
    git(tree, "merge", "-q", "--no-commit", "--no-ff", "side")


def start_conflicted_merge(tree: Path) -> None:
    side_branch(tree, "main\n", "side\n")
    git(tree, "merge", "-q", "side", check=False)


def start_cherry_pick(tree: Path) -> None:
    side_branch(tree, "main\n", "side\n")
    git(tree, "cherry-pick", "side", check=False)


def start_revert(tree: Path) -> None:
    side_branch(tree, "main\n", "side\n")
    (tree / "NOTES.md").write_text("later\n")
    commit_all(tree, "later")
    git(tree, "revert", "--no-edit", "HEAD~1", check=False)


def start_bisect(tree: Path) -> None:  # a bisect checks out a commit: detached, clean
    for n in range(3):
        (tree / "NOTES.md").write_text(f"{n}\n")
        commit_all(tree, f"n{n}")
    git(tree, "bisect", "start", "HEAD", "HEAD~3")


OPERATIONS = {
    "rebase": (start_rebase, "a rebase", "git rebase --abort"),
    "conflicted-rebase": (start_conflicted_rebase, "a rebase", "git rebase --continue"),
    "am": (start_am, "a `git am`", "git am --abort"),
    "merge": (start_merge, "a merge", "git merge --abort"),
    "conflicted-merge": (start_conflicted_merge, "a merge", "git merge --abort"),
    "cherry-pick": (start_cherry_pick, "a cherry-pick", "git cherry-pick --abort"),
    "revert": (start_revert, "a revert", "git revert --abort"),
    "bisect": (start_bisect, "a bisect", "git bisect reset"),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_operation_in_progress_is_refused_naming_it(trees, tmp_path, name):
    start, what, how = OPERATIONS[name]
    tree = copy(trees, "original", tmp_path / "t")
    start(tree)
    before = tree_state(tree)
    code, _, err = apply(tree)
    assert code == 2 and f"{what} is in progress" in one_line_error(err) and how in err, err
    assert "Nothing was changed" in err
    assert tree_state(tree) == before


def test_revert_during_a_rebase_is_refused_and_apply_goes_through_after_the_abort(trees, tmp_path):
    tree = copy(trees, "applied", tmp_path / "t")
    start_rebase(tree)
    before = tree_state(tree)
    code, _, err = run_cli("patch", "revert", SET, "--tree", str(tree))
    assert code == 2 and "a rebase is in progress" in one_line_error(err) and "git rebase --abort" in err
    assert tree_state(tree) == before
    git(tree, "rebase", "--abort")
    code, _, err = run_cli("patch", "revert", SET, "--tree", str(tree))
    assert code == 0, err
    assert git(tree, "log", "-1", "--format=%s").startswith("rl-msprobe: revert")


def test_an_operation_is_the_worktrees_own(trees, tmp_path):
    """A linked worktree has its own rebase state: one in the main checkout blocks nothing there."""
    tree = copy(trees, "original", tmp_path / "t")
    git(tree, "branch", "second")
    linked = tmp_path / "linked"
    git(tree, "worktree", "add", "-q", str(linked), "second")
    start_rebase(tree)
    code, _, err = apply(linked)
    assert code == 0, err
    assert git(linked, "log", "-1", "--format=%s").startswith("rl-msprobe: apply")
    assert (tree / ".git" / "rebase-merge").is_dir()  # the main checkout's rebase, untouched
    start_rebase(linked)
    before = tree_state(linked)
    code, _, err = run_cli("patch", "revert", SET, "--tree", str(linked))
    assert code == 2 and "a rebase is in progress" in one_line_error(err) and "worktrees" in err, err
    assert tree_state(linked) == before


# ---------------------------------------------------------------- 2: hidden edits


@pytest.mark.parametrize("flag", ["--assume-unchanged", "--skip-worktree"])
@pytest.mark.parametrize("allow_dirty", [False, True])
def test_a_hidden_edit_in_a_patched_file_is_refused_naming_it(trees, tmp_path, flag, allow_dirty):
    tree = copy(trees, "original", tmp_path / "t")
    git(tree, "update-index", flag, FSDP)
    path = tree / FSDP
    path.write_bytes(path.read_bytes() + b"\n# my hidden edit\n")
    assert git(tree, "status", "--porcelain") == ""  # git itself shows nothing
    before = tree_state(tree)
    code, _, err = apply(tree, *(["--allow-dirty"] if allow_dirty else []))
    assert code == 2 and FSDP in one_line_error(err) and flag.removeprefix("--") in err, err
    assert "hidden from git status" in err and f"--no-{flag.removeprefix('--')}" in err
    assert tree_state(tree) == before and path.read_bytes().endswith(b"# my hidden edit\n")


def test_a_hidden_edit_in_a_file_the_revert_touches_is_refused(trees, tmp_path):
    tree = copy(trees, "applied", tmp_path / "t")
    git(tree, "update-index", "--assume-unchanged", MEGATRON)
    (tree / MEGATRON).write_bytes((tree / MEGATRON).read_bytes() + b"# mine\n")
    before = tree_state(tree)
    code, _, err = run_cli("patch", "revert", SET, "--tree", str(tree))
    assert code == 2 and MEGATRON in one_line_error(err) and "assume-unchanged" in err
    assert tree_state(tree) == before


def test_a_flag_without_an_edit_is_no_reason_to_refuse(trees, tmp_path):
    tree = copy(trees, "original", tmp_path / "t")
    git(tree, "update-index", "--assume-unchanged", FSDP)
    code, _, err = apply(tree)
    assert code == 0, err
    assert git(tree, "show", f"HEAD:{FSDP}") == (tree / FSDP).read_text()
    assert git(tree, "show", f"HEAD:{FSDP}") == (trees["applied"] / FSDP).read_text()


def test_files_a_sparse_checkout_leaves_out_are_named_not_called_drift(trees, tmp_path):
    tree = copy(trees, "original", tmp_path / "t")
    git(tree, "status", "--porcelain")  # a copied tree's index is stat-dirty: refreshed first
    git(tree, "sparse-checkout", "set", "--no-cone", "/verl/utils/", "/verl/__init__.py", "/verl/version/")
    assert not (tree / MEGATRON).exists()
    before = tree_state(tree)
    code, _, err = apply(tree)
    assert code == 2 and MEGATRON in one_line_error(err) and "sparse checkout" in err, err
    assert "git sparse-checkout" in err and "drift" not in err
    assert tree_state(tree) == before


# ---------------------------------------------------------------- 3: the index lock from the first write


def test_a_users_commit_am_while_the_tool_writes_fails_and_takes_nothing(trees, tmp_path, monkeypatch):
    """At each write a real `git commit -am` of the user's runs in another process: git refuses it
    (index.lock held), so it never swallows the tool's files; afterwards it goes through with the
    user's own file only."""
    tree = copy(trees, "original", tmp_path / "t")
    (tree / "NOTES.md").write_text("base\n")
    commit_all(tree, "notes")
    (tree / "NOTES.md").write_text("my edit\n")
    tries: list[subprocess.CompletedProcess[str]] = []
    checkpoint = journal.checkpoint

    def user_commits(step: str) -> None:
        checkpoint(step)
        if step.startswith(("write:", "replace:", "ref", "head")):
            tries.append(
                subprocess.run(
                    ["git", "commit", "-qam", "mine"],
                    cwd=tree,
                    capture_output=True,
                    text=True,
                    env=gitenv.env(),
                )
            )

    monkeypatch.setattr(journal, "checkpoint", user_commits)
    code, _, err = apply(tree, "--allow-dirty")
    assert code == 0, err
    assert len(tries) >= 6 and all(t.returncode != 0 and "index.lock" in t.stderr for t in tries), tries
    assert git(tree, "log", "-1", "--format=%s").startswith("rl-msprobe: apply verl-engine")
    assert git(tree, "status", "--porcelain") == " M NOTES.md\n"
    for rel in PATHS:
        assert git(tree, "show", f"HEAD:{rel}") == (trees["applied"] / rel).read_text()
    git(tree, "commit", "-qam", "mine")  # now it goes through, with the user's file only
    assert git(tree, "show", "--name-only", "--format=", "HEAD").split() == ["NOTES.md"]


def test_a_users_commit_loop_in_a_thread_never_swallows_the_tools_files(trees, tmp_path):
    """A real concurrent `git commit -am` loop while `patch apply` runs: every commit of the user's
    holds NOTES.md only, the tool's commit its files only, and the tree agrees with HEAD."""
    tree = copy(trees, "original", tmp_path / "t")
    (tree / "NOTES.md").write_text("0\n")
    commit_all(tree, "notes")
    stop = threading.Event()
    made: list[str] = []

    def user() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            (tree / "NOTES.md").write_text(f"{n}\n")
            proc = subprocess.run(
                ["git", "commit", "-qam", f"mine {n}"],
                cwd=tree,
                capture_output=True,
                text=True,
                env=gitenv.env(),
            )
            if proc.returncode == 0:
                made.append(git(tree, "rev-parse", "HEAD").strip())
            stop.wait(0.01)

    thread = threading.Thread(target=user)
    thread.start()
    try:
        for _ in range(4):  # applies racing the user's commits: each goes through or is refused cleanly
            code, _, err = apply(tree, "--allow-dirty", "--no-branch")
            if code == 0:
                break
            refusals = (
                "HEAD moved",
                "another git command holds the index",
                "index lock is there",
                "uncommitted",
            )
            assert any(r in err for r in refusals), err
            assert not git(tree, "log", "--format=%H", "--grep=^rl-msprobe: apply").split()
    finally:
        stop.set()
        thread.join()
    if code != 0:  # the user stopped: now it goes through
        code, _, err = apply(tree, "--allow-dirty", "--no-branch")
    assert code == 0, err
    (tree / "NOTES.md").write_text(git(tree, "show", "HEAD:NOTES.md"))  # the user's last edit put back
    assert git(tree, "status", "--porcelain") == ""
    for sha in made:
        assert git(tree, "show", "--name-only", "--format=", sha).split() == ["NOTES.md"]
    tool = git(tree, "log", "--format=%H", "--grep=^rl-msprobe: apply").split()
    assert len(tool) == 1 and sorted(
        git(tree, "show", "--name-only", "--format=", tool[0]).split()
    ) == sorted(PATHS)
    for rel in PATHS:
        assert (
            (tree / rel).read_text()
            == (trees["applied"] / rel).read_text()
            == git(tree, "show", f"HEAD:{rel}")
        )


# ---------------------------------------------------------------- 3: a full disk, a failing filter


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 4 MiB tmpfs (root only); skipped where mounting is not permitted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(
            f"mount -t tmpfs not permitted here ({proc.stderr.decode().strip()}); ENOSPC is injected "
            "in test_patch_faults instead"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0


@pytest.mark.parametrize("op", ["apply", "revert"])
def test_a_disk_at_zero_bytes_refuses_in_one_line_and_changes_nothing(trees, small_disk, op):
    tree = copy(trees, "original" if op == "apply" else "applied", small_disk / "t")
    fill(small_disk)
    before = tree_state(tree)
    code, _, err = run_cli("patch", op, SET, "--tree", str(tree))
    assert code == 2 and "0 bytes free" in one_line_error(err) and "Nothing was changed" in err, err
    assert tree_state(tree) == before
    (small_disk / "filler").unlink()
    code, _, err = run_cli("patch", op, SET, "--tree", str(tree))
    assert code == 0, err


@pytest.mark.parametrize("stat_dirty", [False, True])
def test_a_failing_required_clean_filter_refuses_in_one_line(trees, tmp_path, stat_dirty):
    tree = copy(trees, "original", tmp_path / "t")
    (tree / ".gitattributes").write_text("*.py filter=boom\n")
    git(tree, "add", ".gitattributes")
    git(tree, "commit", "-qm", "a filter")
    git(tree, "config", "filter.boom.clean", "false")  # then it fails, as a broken filter program does
    git(tree, "config", "filter.boom.smudge", "cat")
    git(tree, "config", "filter.boom.required", "true")
    if stat_dirty:  # git must run the filter to know the files are unchanged
        for rel in (FSDP, MEGATRON):
            os.utime(tree / rel, (1, 1))
    before = {k: v for k, v in tree_state(tree).items() if k != "git:status"}
    code, _, err = apply(tree)
    assert code == 2 and "clean filter 'boom' failed" in one_line_error(err), err
    assert "Nothing was changed" in err
    assert {k: v for k, v in tree_state(tree).items() if k != "git:status"} == before
    assert not (Path(tree) / ".git" / "index.lock").exists()

"""Killed, concurrent and starved runs of `patch apply` / `patch revert` leave nothing half-done.

A real SIGKILL at every named step of apply and revert (the test-only RL_MSPROBE_FAULT_AT hook makes
the tool kill itself there), then the next command: the tree is fully original or fully
patched-and-committed, `status` says which, no stale branch. The trees hold the verl-engine files of
the real verl 0.9.1 release, as git repos and as plain folders. Runs that must die are forked from
this process (no interpreter start-up), so a sweep takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rl_msprobe.cli import main
from tests.support.trees import git, release_subset, run_cli, tree_state

SET = "verl-engine"
PATHS = [
    "verl/utils/rl_msprobe_hooks.py",
    "verl/workers/engine/fsdp/transformer_impl.py",
    "verl/workers/engine/megatron/transformer_impl.py",
]
BRANCH = "rl-msprobe/verl-engine"
pytestmark = pytest.mark.release


@dataclass(frozen=True)
class Templates:
    original: Path
    applied: Path
    original_state: dict
    applied_state: dict
    reverted_state: dict


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Templates]:
    base = tmp_path_factory.mktemp("crash")
    out = {}
    for kind in ("git", "plain"):
        original = release_subset("verl", "0.9.1", base / f"{kind}-original", PATHS, with_git=kind == "git")
        applied = _copy(original, base / f"{kind}-applied")
        code, _, err = run_cli("patch", "apply", SET, "--tree", str(applied))
        assert code == 0, err
        reverted = _copy(applied, base / f"{kind}-reverted")
        code, _, err = run_cli("patch", "revert", SET, "--tree", str(reverted))
        assert code == 0, err
        out[kind] = Templates(
            original, applied, tree_state(original), tree_state(applied), tree_state(reverted)
        )
    return out


def fork_cli(
    args: list[str], env: dict[str, str], stdout: Path | None = None, gate: int | None = None
) -> int:
    """Run `rl-msprobe ARGS` in a forked child (optionally waiting on a pipe first); returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 98
    try:
        sys.stdout = open(stdout or os.devnull, "w")  # noqa: SIM115 - this process ends with os._exit
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        os.environ.update(env)
        if gate is not None:
            os.read(gate, 1)
        try:
            main.main(args=args, prog_name="rl-msprobe", standalone_mode=False)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - a traceback: the test sees 99
            code = 99
    finally:
        sys.stdout.flush()
        os._exit(code)


def paused(op: str, tree: Path, step: str) -> subprocess.Popen[str]:
    """`rl-msprobe patch OP` in its own interpreter, returned once it has stopped at `step` (kill it)."""
    env = {**os.environ, "RL_MSPROBE_FAULT_AT": step, "RL_MSPROBE_FAULT": "pause"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_msprobe", "patch", op, SET, "--tree", str(tree)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith(f"rl-msprobe paused at {step}")
    return proc


def wait(pid: int) -> int:
    """The child's exit code, or -N when signal N ended it."""
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def steps_of(op: str, tree: Path) -> list[str]:
    log = tree.parent / f"{tree.name}.steps"
    code = wait(fork_cli(["patch", op, SET, "--tree", str(tree)], {"RL_MSPROBE_STEPS_LOG": str(log)}))
    assert code == 0
    # before journal-write nothing is recorded; replace:* (a temporary file beside each write) has its own test
    steps = [s for s in log.read_text().split() if s != "journal-write" and not s.startswith("replace:")]
    writes = [s for s in steps if s.startswith("write:")]
    keep = {writes[0], writes[len(writes) // 2], writes[-1]}  # each write step is alike: first, middle, last
    return [s for s in steps if not s.startswith("write:") or s in keep]


def status_of(tree: Path) -> tuple[int, dict]:
    code, out, _ = run_cli("patch", "status", SET, "--tree", str(tree), "--json")
    return code, json.loads(out)


@pytest.mark.parametrize("kind", ["git", "plain"])
@pytest.mark.parametrize("op", ["apply", "revert"])
def test_kill_at_every_step_then_next_command_finishes_or_undoes(kind, op, templates, tmp_path):
    t = templates[kind]
    start, before, after = (
        (t.original, t.original_state, t.applied_state)
        if op == "apply"
        else (t.applied, t.applied_state, t.reverted_state)
    )
    steps = steps_of(op, _copy(start, tmp_path / "trace"))
    assert steps[0] == "journal" and len(steps) >= 4, steps
    if kind == "git":  # the commit exists as objects before the first write; the ref moves last
        # git's index lock is taken before the first file is written and held until the commit is in
        assert steps[1] == "index-lock" and steps[2].startswith("write:"), steps
        tail = ["ref", "head", "published"] if op == "apply" else ["ref", "published"]
        assert steps[-len(tail) :] == tail, steps
    for index, step in enumerate(steps):
        tree = _copy(start, tmp_path / f"t{index}")
        code = wait(fork_cli(["patch", op, SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": step}))
        assert code == -signal.SIGKILL, f"{step}: {code}"
        status, doc = status_of(tree)
        completed = step in ("ref", "head", "published")
        assert doc["journal"]["op"] == op and doc["journal"]["outcome"] == (
            "completed" if completed else "rolled back"
        ), (step, doc.get("journal"))
        state = tree_state(tree)
        expected = after if completed else before
        assert state == expected, f"killed at {step}: the tree is neither before nor after {op}"
        applied = (expected is t.applied_state) if op == "apply" else expected is before
        assert (status == 0) is applied and doc["sets"][0]["status"] == ("applied" if applied else "absent")
        if index == len(steps) // 2:  # and the command itself now goes through, as if never interrupted
            code, _, err = run_cli("patch", op, SET, "--tree", str(tree))
            assert code == 0, err
            assert tree_state(tree) == after, f"killed at {step}, then {op} again"


def test_killed_apply_is_undone_by_the_next_apply_which_then_applies(templates, tmp_path):
    t = templates["git"]
    tree = _copy(t.original, tmp_path / "t")
    code = wait(
        fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": f"write:{PATHS[1]}"})
    )
    assert code == -signal.SIGKILL
    assert BRANCH not in git(tree, "branch")  # the kill left a half-written tree; no branch before the commit
    code, out, err = run_cli("patch", "apply", SET, "--tree", str(tree), "--json")
    assert code == 0, err
    assert json.loads(out)["recovered"]["outcome"] == "rolled back"
    assert tree_state(tree) == t.applied_state


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_kill_mid_write_leaves_no_temporary_file(kind, templates, tmp_path):
    t = templates[kind]
    tree = _copy(t.original, tmp_path / "t")
    step = f"replace:{PATHS[1]}"
    assert wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": step})) == -9
    assert any(p.name.startswith(".transformer_impl.py.") for p in (tree / PATHS[1]).parent.iterdir())
    status, doc = status_of(tree)
    assert doc["journal"]["outcome"] == "rolled back" and status == 1
    assert tree_state(tree) == t.original_state


def test_external_kill_while_paused_after_the_journal(templates, tmp_path):
    """The same with a kill -9 from outside, in a separate interpreter paused at a step."""
    t = templates["git"]
    tree = _copy(t.original, tmp_path / "t")
    proc = paused("apply", tree, f"write:{PATHS[1]}")
    try:
        assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"  # HEAD moves last
        code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))  # the lock is held: refused
        assert code == 2 and f"another rl-msprobe is patching this tree (pid {proc.pid})" in err
        status, doc = status_of(tree)
        assert doc["journal"] == {"outcome": "in progress", "pid": str(proc.pid)}
    finally:
        proc.kill()
        proc.wait()
    status, doc = status_of(tree)
    assert doc["journal"]["outcome"] == "rolled back" and status == 1
    assert tree_state(tree) == t.original_state


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_simultaneous_applies_exactly_one_wins(kind, templates, tmp_path):
    t = templates[kind]
    for pair in range(5):
        tree = _copy(t.original, tmp_path / f"t{pair}")
        read, write = os.pipe()
        outs = [tmp_path / f"t{pair}.{i}.json" for i in range(2)]
        env = {"RL_MSPROBE_LOCK_WAIT": "0.05" if pair % 2 else "10"}
        pids = [
            fork_cli(["patch", "apply", SET, "--tree", str(tree), "--json"], env, out, gate=read)
            for out in outs
        ]
        os.write(write, b"go")
        codes = [wait(pid) for pid in pids]
        os.close(read)
        os.close(write)
        docs = [json.loads(out.read_text()) if code == 0 else None for code, out in zip(codes, outs)]
        winners = [d for d in docs if d and not d["noop"]]
        assert len(winners) == 1, (codes, docs)
        assert sorted(codes) in ([0, 0], [0, 2]), codes  # the other saw it applied, or was refused
        assert tree_state(tree) == t.applied_state


def test_second_command_waits_then_refuses_with_the_holders_pid(templates, tmp_path, monkeypatch):
    from rl_msprobe.engine import journal

    tree = _copy(templates["plain"].original, tmp_path / "t")
    monkeypatch.setenv("RL_MSPROBE_LOCK_WAIT", "0.2")
    with journal.tree_lock(journal.state_dir(tree, None)):
        code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
        assert code == 2 and f"another rl-msprobe is patching this tree (pid {os.getpid()})" in err
    assert tree_state(tree) == templates["plain"].original_state, "the lock leaves nothing behind"


def test_a_git_command_killed_with_the_run_leaves_an_index_lock_the_next_run_removes(templates, tmp_path):
    """rl-msprobe killed while its git child held `.git/index.lock`: the lock outlives them both, and
    every git command refuses to run. The next rl-msprobe command knows it as the killed run's own."""
    t = templates["git"]
    tree = _copy(t.original, tmp_path / "t")
    assert (
        wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": "journal"})) == -9
    )
    lock = tree / ".git" / "index.lock"
    lock.write_bytes(b"")  # what the killed `git add` left (made after the run's journal)
    code, out, err = run_cli("patch", "apply", SET, "--tree", str(tree), "--json")
    assert code == 0, err
    recovered = json.loads(out)["recovered"]
    assert recovered["outcome"] == "rolled back" and recovered["removed"] == str(lock)
    assert not lock.exists() and tree_state(tree) == t.applied_state


def test_an_index_lock_that_is_not_ours_is_refused_by_name(templates, tmp_path):
    """A lock older than any rl-msprobe run (another git command running, or one killed long ago):
    exit 2 naming the file and what to do, the lock and the tree untouched."""
    t = templates["git"]
    tree = _copy(t.original, tmp_path / "t")
    lock = tree / ".git" / "index.lock"
    lock.write_bytes(b"")
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and str(lock) in err and "remove the file if no git process is running" in err, err
    assert lock.exists() and tree_state(tree) == t.original_state
    lock.unlink()
    # killed after its journal, with an index.lock from before that run: not removed, named
    assert (
        wait(fork_cli(["patch", "apply", SET, "--tree", str(tree)], {"RL_MSPROBE_FAULT_AT": "journal"})) == -9
    )
    lock.write_bytes(b"")
    os.utime(lock, (1, 1))
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 2 and str(lock) in err, err
    lock.unlink()
    code, _, err = run_cli("patch", "apply", SET, "--tree", str(tree))
    assert code == 0 and tree_state(tree) == t.applied_state, err

"""Test helpers shared by every patch-set test: real releases copied into scratch git repos,
and the full patch cycle (diff -> git apply --check -> apply -> status -> compile -> second
apply no-op -> byte-exact revert -> branch and commit)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.upstream.release_cache import fetch_release


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run `rl-msprobe ARGS` in-process; returns (exit code, stdout, stderr)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def init_repo(path: Path) -> Path:
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "tests@rl-msprobe")
    git(path, "config", "user.name", "rl-msprobe tests")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "upstream release")
    return path


def scratch_copy(project: str, version: str, dest: Path, with_git: bool = True) -> Path:
    """A writable copy of a release fetched from the package index (cached), as a git repo."""
    root = fetch_release(project, version)
    shutil.copytree(root, dest, symlinks=True)
    return init_repo(dest) if with_git else dest


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def full_cycle(tree: Path, sets: list[str]) -> dict:
    """Run the whole cycle on a scratch git tree and assert each step; returns the status JSON."""
    before = snapshot(tree)
    code, diff, err = run_cli("patch", "diff", *sets, "--tree", str(tree), "--exit-code")
    assert code == 1, f"diff should report pending changes: {err}"
    patch_file = tree.parent / f"{tree.name}.patch"
    patch_file.write_text(diff)
    subprocess.run(["git", "apply", "--check", str(patch_file)], cwd=tree, check=True)
    subprocess.run(["patch", "-p1", "--dry-run", "-s", "-i", str(patch_file)], cwd=tree, check=True)

    code, out, err = run_cli("patch", "apply", *sets, "--tree", str(tree), "--json")
    assert code == 0, err
    applied = json.loads(out)
    assert applied["git"]["branch"] == "rl-msprobe/" + "+".join(sets)
    assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == applied["git"]["branch"]
    message = git(tree, "log", "-1", "--format=%B")
    assert all(s in message for s in sets) and "rl-msprobe" in message

    code, out, err = run_cli("patch", "status", *sets, "--tree", str(tree), "--json")
    status = json.loads(out)
    assert code == 0, json.dumps(status, indent=1)
    for rel in applied["changed"]:
        if rel.endswith(".py"):
            compile((tree / rel).read_bytes(), str(tree / rel), "exec")  # leaves no __pycache__ behind
    assert git(tree, "status", "--porcelain").strip() == ""

    after_apply = snapshot(tree)
    code, out, _ = run_cli("patch", "apply", *sets, "--tree", str(tree), "--json")
    assert code == 0 and json.loads(out)["noop"] is True
    assert snapshot(tree) == after_apply
    code, _, _ = run_cli("patch", "diff", *sets, "--tree", str(tree), "--exit-code")
    assert code == 0, "no changes may be pending after apply"

    code, out, err = run_cli("patch", "revert", *sets, "--tree", str(tree), "--json")
    assert code == 0, err
    assert snapshot(tree) == before, "revert must give back the original bytes"
    code, out, _ = run_cli("patch", "status", *sets, "--tree", str(tree), "--json")
    assert code == 1 and all(s["status"] in ("absent", "not-applicable") for s in json.loads(out)["sets"])
    return status


def patched_release(project: str, version: str, dest: Path, sets: list[str], with_git: bool = True) -> Path:
    """A scratch copy of a real release with `sets` applied by `rl-msprobe patch apply` (status checked)."""
    tree = scratch_copy(project, version, dest, with_git=with_git)
    extra = ["--no-branch"] if with_git else []
    code, _, err = run_cli("patch", "apply", *sets, "--tree", str(tree), *extra)
    assert code == 0, err
    code, out, _ = run_cli("patch", "status", *sets, "--tree", str(tree), "--json")
    assert code == 0 and all(s["status"] == "applied" for s in json.loads(out)["sets"]), out
    return tree


# the keys of a dispatch_log.jsonl line, in order (DOMAIN §6), for vLLM and vLLM-Ascend alike
DISPATCH_LOG_KEYS = [
    "source",
    "timestamp",
    "pid",
    "rank",
    "step",
    "phase",
    "total_num_scheduled_tokens",
    "requests",
]


def release_subset(project: str, version: str, dest: Path, paths: list[str], with_git: bool = True) -> Path:
    """A small writable tree: only `paths` (plus the package's __init__ and version files) of a real release.

    For tests that patch many scratch trees (crash and concurrency sweeps): the same upstream bytes as
    `scratch_copy`, copied in milliseconds.
    """
    root = fetch_release(project, version)
    package = root / paths[0].split("/")[0]
    wanted = [*paths, f"{package.name}/__init__.py", f"{package.name}/version/version"]
    for rel in wanted:
        if (root / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dest / rel)
    return init_repo(dest) if with_git else dest


def tree_state(root: Path) -> dict[str, object]:
    """Everything a patch command may change: files (a symlink as its link), branches, HEAD, index, status."""
    state: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if ".git" in rel.parts:
            continue
        if p.is_symlink():
            state[str(rel)] = f"symlink -> {os.readlink(p)}"
        elif p.is_file():
            state[str(rel)] = p.read_bytes()
    if (root / ".git").exists():
        for key, args in {
            "branches": ["branch", "--format=%(refname:short)"],
            "commits": ["rev-list", "--count", "HEAD"],
            "head": ["rev-parse", "--abbrev-ref", "HEAD"],
            "status": ["status", "--porcelain"],
            "tree": ["rev-parse", "HEAD^{tree}"],
            "index": ["ls-files", "--stage"],
        }.items():
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
            state[f"git:{key}"] = (proc.returncode, proc.stdout)
    return state

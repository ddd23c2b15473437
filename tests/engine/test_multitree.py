"""`patch apply|revert SET... --python PY` with sets of two projects: one command over the two trees
that interpreter imports, each tree all or nothing and the command too (a failure in the second tree
takes the first one back).

Trees: the pieces' files of the real verl 0.9.1 and vLLM 0.33.0 releases, as two git repos, or both
packages in one plain folder (as in a venv's site-packages, where the two share rl-msprobe's state
folder). The interpreter is this one with PYTHONPATH pointing at them (found without importing).
A failure in the second tree: "no space left on device" raised once, at its model runner's write (the
test-only checkpoint hook, as in test_patch_faults).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rl_msprobe.patches import get_set
from tests.support.trees import release_subset, run_cli, tree_state

pytestmark = pytest.mark.release
SETS = ("verl-prompts-only", "vllm-dump")
VLLM_RUNNER = "vllm/v1/worker/gpu_model_runner.py"


def _paths(name: str) -> list[str]:
    patch_set = get_set(name)
    paths = {p.path for p in patch_set.all_pieces()}
    paths |= {c.probe.path for c in patch_set.all_capabilities() if c.probe}
    return sorted(paths) + (["vllm/_version.py"] if patch_set.project == "vllm" else [])


def _trees(tmp_path: Path, layout: str) -> tuple[list[Path], str]:
    """The folders to compare and the --python value importing verl and vllm from them."""
    if layout == "two-repos":
        verl = release_subset("verl", "0.9.1", tmp_path / "verl", _paths(SETS[0]))
        vllm = release_subset("vllm", "0.33.0", tmp_path / "vllm", _paths(SETS[1]))
        roots = [verl, vllm]
    else:
        site = tmp_path / "site-packages"
        release_subset("verl", "0.9.1", site, _paths(SETS[0]), with_git=False)
        release_subset("vllm", "0.33.0", site, _paths(SETS[1]), with_git=False)
        roots = [site]
    return roots, f"env PYTHONPATH={':'.join(map(str, roots))} {sys.executable}"


def _full_disk_at(step: str, monkeypatch) -> None:
    def checkpoint(name: str) -> None:
        if name == step:
            raise OSError(28, "No space left on device", name)

    monkeypatch.setattr("rl_msprobe.engine.journal.checkpoint", checkpoint)


def _states(roots: list[Path]) -> list[dict]:
    return [tree_state(root) for root in roots]


@pytest.mark.parametrize("layout", ["two-repos", "one-site-packages"])
def test_apply_and_revert_sets_of_two_projects_in_one_command(tmp_path: Path, layout: str) -> None:
    roots, python = _trees(tmp_path, layout)
    before = _states(roots)
    code, out, err = run_cli("patch", "apply", *SETS, "--python", python, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [t["project"] for t in doc["trees"]] == ["verl", "vllm"] and doc["sets"] == list(SETS)
    code, out, _ = run_cli("patch", "status", *SETS, "--python", python, "--json")
    assert code == 0 and {s["status"] for s in json.loads(out)["sets"]} == {"applied"}, out
    code, out, err = run_cli("patch", "revert", *SETS, "--python", python)
    assert code == 0, err
    assert "reverted verl-prompts-only" in out and "reverted vllm-dump" in out
    after = _states(roots)
    if layout == "two-repos":  # the apply and revert commits stay in the history, the files are as before
        for state in (*before, *after):
            for key in ("git:branches", "git:commits", "git:head", "git:tree"):
                state.pop(key)
    assert after == before


@pytest.mark.parametrize("layout", ["two-repos", "one-site-packages"])
def test_a_failure_in_the_second_tree_takes_the_first_back(tmp_path: Path, layout: str, monkeypatch) -> None:
    roots, python = _trees(tmp_path, layout)
    before = _states(roots)
    with monkeypatch.context() as patched:
        _full_disk_at(f"write:{VLLM_RUNNER}", patched)
        code, _, err = run_cli("patch", "apply", *SETS, "--python", python)
    assert code == 2 and "No space left" in err and "taken back" in err, err
    assert _states(roots) == before  # files, branches, HEAD, index: the verl tree's apply is gone too
    code, _, err = run_cli("patch", "apply", *SETS, "--python", python)
    assert code == 0, err
    applied = _states(roots)
    _full_disk_at(f"write:{VLLM_RUNNER}", monkeypatch)
    code, _, err = run_cli("patch", "revert", *SETS, "--python", python)
    assert code == 2 and "taken back" in err, err
    assert _states(roots) == applied


def test_with_tree_sets_of_two_projects_are_still_refused(tmp_path: Path) -> None:
    roots, _ = _trees(tmp_path, "two-repos")
    code, _, err = run_cli("patch", "apply", *SETS, "--tree", str(roots[0]))
    assert code == 2 and "one tree at a time" in err, err

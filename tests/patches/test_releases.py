"""Every patch set has a default release (used by `patch diff SET` with no tree, shown by
`patch list`), and it is a release the suite runs the full patch cycle on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from rl_msprobe.codemods.base import version_in_range
from rl_msprobe.patches import all_sets
from rl_msprobe.patches.default_release import default_release
from tests.support.trees import run_cli


def _full_cycle_matrices() -> dict[str, list[str]]:
    """project -> the releases its release tests run the full cycle (diff, apply, revert) on."""
    from tests.patches import (
        test_sglang_releases,
        test_verl_engine_releases,
        test_vllm_ascend_releases,
        test_vllm_releases,
    )

    return {
        "verl": list(test_verl_engine_releases.VERSIONS),
        "sglang": list(test_sglang_releases.FULL_CYCLE),
        "vllm": list(test_vllm_releases.FULL_CYCLE),
        "vllm-ascend": [v for v, _, _ in test_vllm_ascend_releases.FULL_CYCLE],
    }


@pytest.mark.parametrize("patch_set", all_sets(), ids=lambda s: s.name)
def test_default_is_the_newest_fully_tested_release(patch_set):
    version = default_release(patch_set)
    tested = _full_cycle_matrices()[patch_set.project]
    if not version_in_range(tested[-1], patch_set.min_version, patch_set.max_version):
        # a set that starts above the project's newest tested release (SGLang's native debugger):
        # the newest release its own release tests cycle
        from tests.patches import test_sglang_releases

        tested = test_sglang_releases.NATIVE_FULL_CYCLE
        assert patch_set.project == "sglang", f"{patch_set.name}: no tested release in its range"
    assert version == tested[-1], f"{patch_set.name}: default {version}, newest tested {tested[-1]}"
    assert version_in_range(version, patch_set.min_version, patch_set.max_version)
    assert patch_set.native_since is None or Version(version) < Version(patch_set.native_since)


def test_every_sets_matrix_ends_at_its_default_release():
    """tests/support/releases.py derives each set's matrix from its registry range: a default release
    (a newer `newest_tested` in upstream/projects.py) missing from its release list fails here."""
    from tests.support.releases import RELEASES, supported

    for project, versions in RELEASES.items():
        assert list(versions) == sorted(versions, key=Version), project
    ends = {s.name: (supported(s.name) or ["none"])[-1] for s in all_sets()}
    assert ends == {s.name: default_release(s) for s in all_sets()}


def test_patch_list_shows_the_default_in_aligned_columns():
    code, out, _ = run_cli("patch", "list", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {e["name"]: e["default_release"] for e in doc} == {s.name: default_release(s) for s in all_sets()}
    code, out, _ = run_cli("patch", "list")
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["SET", "PROJECT", "VERSIONS", "DEFAULT", "DESCRIPTION"]
    # every column starts at the same offset on every row (the header's)
    starts = [lines[0].index(word) for word in ("PROJECT", "VERSIONS", "DEFAULT", "DESCRIPTION")]
    for line, entry in zip(lines[1:], doc, strict=True):
        cells = [entry["project"], entry["versions"], entry["default_release"], entry["description"]]
        assert [line.index(cell, start) for cell, start in zip(cells, starts)] == starts, line


@pytest.mark.release
@pytest.mark.parametrize("patch_set", all_sets(), ids=lambda s: s.name)
def test_diff_with_no_tree_works_for_every_set(patch_set):
    """`patch diff SET` (no --tree): the default release, exit 0 like git, the diff on stdout and
    the summary on stderr (--exit-code is exercised by every full cycle in tests/support/trees.py)."""
    code, out, err = run_cli("patch", "diff", patch_set.name)
    assert code == 0, err
    assert out.startswith("diff --git ") and "\n+" in out
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"# {patch_set.project} {default_release(patch_set)} at ")
    files, hunks = out.count("diff --git "), sum(line.startswith("@@ ") for line in out.splitlines())
    assert f": {files} file{'s' * (files != 1)}, {hunks} hunk{'s' * (hunks != 1)}, +" in summary, summary


def test_the_planner_assumes_the_verl_release_the_sets_default_to():
    """One source of truth: the planner's assumed verl is the verl sets' default release and their
    newest tested one; changing the one table row moves all three (checked in a fresh interpreter)."""
    from rl_msprobe.upstream.projects import project

    verl_sets = [s for s in all_sets() if s.project == "verl"]
    assert {default_release(s) for s in verl_sets} == {project("verl").assumed_version}
    code = (
        "import dataclasses, json, rl_msprobe.upstream.projects as u\n"
        "u.PROJECTS = tuple(dataclasses.replace(p, newest_tested='9.9.9') if p.name == 'verl' else p"
        " for p in u.PROJECTS)\n"
        "from rl_msprobe.patches import all_sets\n"
        "from rl_msprobe.patches.default_release import default_release\n"
        "verl = [s for s in all_sets() if s.project == 'verl']\n"
        "print(json.dumps([u.project('verl').assumed_version, sorted({default_release(s) for s in verl}),"
        " sorted({s.max_version for s in verl})]))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["9.9.9", ["9.9.9"], ["9.9.9"]]

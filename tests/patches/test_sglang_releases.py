"""sglang-dump (and sglang-bootstrap-room) on real SGLang releases below 0.5.11 from 0.4.6.post5,
fetched from the package index (cached); the refusal on 0.5.11, where SGLang dumps natively.

The full cycle runs on one release per code shape: releases whose diff is the same hunk for hunk
(line numbers aside) share the representative's result. RL_MSPROBE_SGLANG_ALL_RELEASES=1 runs
every release and re-checks the grouping (do that when an SGLang codemod changes).
"""

from __future__ import annotations

import ast
import json
import os
import re

import pytest
from packaging.version import Version

from rl_msprobe.codemods.sglang_model_runner import SGLangModelRunner
from rl_msprobe.patches import get_set
from tests.support.releases import supported
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy, snapshot

pytestmark = pytest.mark.release

# every release on the index in sglang-dump's range (0.4.6.post5 below 0.5.11; tests/support/releases.py)
VERSIONS = supported("sglang-dump")
# representative -> the releases whose diff equals its own but for line numbers (measured on every
# release above with the codemods of Nov 2026: 41 releases, 13 shapes). A representative is the
# newest of its group, except 0.5.1, which the refusal test below fetches anyway.
SHAPES = {
    "0.4.6.post5": (),
    "0.4.7.post1": ("0.4.7",),
    "0.4.8.post1": ("0.4.8",),
    "0.4.9.post2": ("0.4.9", "0.4.9.post1"),
    "0.4.10.post2": ("0.4.9.post3", "0.4.9.post4", "0.4.9.post5", "0.4.9.post6", "0.4.10", "0.4.10.post1"),
    "0.5.1": ("0.5.1.post1", "0.5.1.post2", "0.5.1.post3"),
    "0.5.2": (),
    "0.5.3.post2": ("0.5.3", "0.5.3.post1"),
    "0.5.3.post3": (),
    "0.5.6": tuple(f"0.5.{m}{p}" for m in (4, 5) for p in ("", ".post1", ".post2", ".post3")),
    "0.5.6.post2": ("0.5.6.post1",),
    "0.5.9": ("0.5.7", "0.5.8", "0.5.8.post1"),
    "0.5.10.post1": ("0.5.10",),
}
ALL_RELEASES = os.environ.get("RL_MSPROBE_SGLANG_ALL_RELEASES") == "1"
FULL_CYCLE = VERSIONS if ALL_RELEASES else sorted(SHAPES, key=Version)
# the releases with SGLang's own msprobe debugger the native-debugger sets (sglang-pd-dump-path)
# cycle (apply, check, revert byte-exactly): the newest is their default release
NATIVE_FULL_CYCLE = supported("sglang-pd-dump-path")
BOOTSTRAP_ROOM_SINCE = Version(get_set("sglang-bootstrap-room").min_version or "0")
DUMP_FILES = {"sglang/srt/model_executor/model_runner.py", "sglang/srt/model_executor/rl_msprobe_dump.py"}
ROOM_FILES = {"sglang/srt/managers/io_struct.py", "sglang/srt/managers/rl_msprobe_bootstrap_room.py"}


def _sets(version: str) -> list[str]:
    return (
        ["sglang-dump", "sglang-bootstrap-room"]
        if Version(version) >= BOOTSTRAP_ROOM_SINCE
        else ["sglang-dump"]
    )


def test_shapes_cover_every_release_once():
    members = [v for rep, others in SHAPES.items() for v in (rep, *others)]
    assert sorted(members, key=Version) == VERSIONS
    assert FULL_CYCLE[0] == VERSIONS[0] and FULL_CYCLE[-1] == VERSIONS[-1]  # oldest and newest always run
    for rep, others in SHAPES.items():  # a group never spans the bootstrap-room boundary
        assert {len(_sets(v)) for v in (rep, *others)} == {len(_sets(rep))}, rep


if ALL_RELEASES:

    @pytest.mark.parametrize("representative", list(SHAPES))
    def test_shape_groups_still_hold(representative):
        """Every release's diff equals its representative's but for line numbers."""

        def shape(version: str) -> str:
            spec = f"release:sglang=={version}"
            code, out, err = run_cli("patch", "diff", *_sets(version), "--tree", spec, "--json")
            assert code == 0, err
            return re.sub(r"^@@ .* @@", "@@", json.loads(out)["diff"], flags=re.M)

        expected = shape(representative)
        assert [v for v in SHAPES[representative] if shape(v) != expected] == []


@pytest.mark.parametrize("version", newest_in_default(FULL_CYCLE))
def test_full_cycle(version, tmp_path):
    tree = scratch_copy("sglang", version, tmp_path / f"sglang-{version}")
    sets = _sets(version)
    with_room = len(sets) == 2
    status = full_cycle(tree, sets)
    assert status["version"] == version
    assert [s["status"] for s in status["sets"]] == ["applied"] * len(sets)
    touched = {f["path"] for s in status["sets"] for f in s["files"]}
    assert touched == (DUMP_FILES | ROOM_FILES if with_room else DUMP_FILES)


def test_marked_lines_on_the_newest_patched_release():
    """What lands where on 0.5.10.post1: the import, create after the counter, start, finish."""
    code, out, err = run_cli(
        "patch", "diff", "sglang-dump", "--tree", "release:sglang==0.5.10.post1", "--json", "--exit-code"
    )
    assert code == 1, err
    diff = json.loads(out)["diff"]
    marker = SGLangModelRunner().marker
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and line.endswith(marker)]
    assert added == [
        f"from sglang.srt.model_executor import rl_msprobe_dump  {marker}",
        f"rl_msprobe_dump.create(self)  {marker}",
        f"rl_msprobe_dump.start(self)  {marker}",
        f"rl_msprobe_dump.finish(self)  {marker}",
    ]
    assert "+        self.forward_pass_id += 1" not in diff  # context, never rewritten


def test_bootstrap_room_refused_before_0_5_2(tmp_path):
    tree = scratch_copy("sglang", "0.5.1", tmp_path / "sglang", with_git=False)
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "sglang-bootstrap-room", "--tree", str(tree))
    assert code == 2
    assert "0.5.1" in err and "0.5.2" in err
    assert snapshot(tree) == before


@pytest.mark.parametrize("version", newest_in_default(NATIVE_FULL_CYCLE))
def test_native_release_refused_names_the_override(version, tmp_path):
    tree = scratch_copy("sglang", version, tmp_path / "sglang")
    before = snapshot(tree)
    for command in ("apply", "diff"):
        code, out, err = run_cli("patch", command, "sglang-dump", "--tree", str(tree))
        assert code == 2, (command, out, err)
        assert "msprobe_dump_config" in err
        assert "++actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config=" in err
    assert snapshot(tree) == before
    code, out, _ = run_cli("patch", "status", "sglang-dump", "--tree", str(tree), "--json")
    doc = json.loads(out)
    assert doc["sets"][0]["status"] == "native"
    assert all(f["status"] == "native" for f in doc["sets"][0]["files"])
    assert "msprobe_dump_config" in doc["sets"][0]["files"][0]["detail"]
    assert code == 0  # native counts as done: nothing to apply


def test_status_tells_native_from_absent(tmp_path):
    old = scratch_copy("sglang", "0.5.10.post1", tmp_path / "old", with_git=False)
    code, out, _ = run_cli("patch", "status", "sglang-dump", "--tree", str(old), "--json")
    assert code == 1 and json.loads(out)["sets"][0]["status"] == "absent"


@pytest.mark.parametrize("version", newest_in_default([VERSIONS[-1], NATIVE_FULL_CYCLE[-1]]))
def test_dispatch_log_with_either_debugger_and_separate_reverts(version, tmp_path):
    """sglang-dispatch-log on real releases: on 0.5.10.post1 together with sglang-dump (both edit
    model_runner.py; each reports applied, and the one applied first reverts alone), on 0.5.12 next
    to SGLang's own msprobe_dump_config debugger. Byte-identical after both reverts."""
    tree = scratch_copy("sglang", version, tmp_path / "sglang", with_git=False)
    before = snapshot(tree)
    sets = ["sglang-dump", "sglang-dispatch-log"] if version == VERSIONS[-1] else ["sglang-dispatch-log"]
    for name in sets:
        code, _, err = run_cli("patch", "apply", name, "--tree", str(tree))
        assert code == 0, err
    code, out, err = run_cli("patch", "status", *sets, "--tree", str(tree), "--json")
    assert code == 0, err
    assert [s["status"] for s in json.loads(out)["sets"]] == ["applied"] * len(sets)
    source = (tree / "sglang/srt/model_executor/model_runner.py").read_text()
    (runner,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner"]
    (forward,) = [n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    first = source.splitlines()[forward.body[0].lineno - 1]  # its first statement: the log line
    assert "rl_msprobe_dispatch.log_forward(self, forward_batch)" in first, first
    # the per-token records start on the same line (RL_MSPROBE_RECORD_DIR): the shared recorder beside it
    records = tree / "sglang/srt/model_executor/rl_msprobe_records.py"
    assert records.read_bytes() == next(
        piece.item.content()
        for piece in get_set("sglang-dispatch-log").all_pieces()
        if piece.label == "sglang-records-file"
    )
    for index, name in enumerate(sets):  # the first applied is reverted first: the other stays applied
        code, _, err = run_cli("patch", "revert", name, "--tree", str(tree))
        assert code == 0, err
        code, out, _ = run_cli("patch", "status", *sets, "--tree", str(tree), "--json")
        statuses = [s["status"] for s in json.loads(out)["sets"]]
        assert statuses == ["absent"] * (index + 1) + ["applied"] * (len(sets) - index - 1), statuses
    assert snapshot(tree) == before


def test_dispatch_log_refused_where_forward_has_no_batch_parameter(tmp_path):
    """A ModelRunner.forward without `forward_batch` (drift) is refused naming the anchor; nothing written."""
    tree = scratch_copy("sglang", "0.5.12", tmp_path / "sglang", with_git=False)
    runner = tree / "sglang/srt/model_executor/model_runner.py"
    signature = "    def forward(\n        self,\n        forward_batch: ForwardBatch,\n"
    assert signature in runner.read_text()
    runner.write_text(runner.read_text().replace(signature, signature.replace("forward_batch:", "batch:"), 1))
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "sglang-dispatch-log", "--tree", str(tree))
    assert code == 2 and "forward(self, forward_batch)" in err, err
    assert snapshot(tree) == before


@pytest.mark.parametrize("version", newest_in_default(NATIVE_FULL_CYCLE))
def test_pd_dump_path_on_native_releases(version, tmp_path):
    """sglang-pd-dump-path where SGLang creates its own debugger: one marked line right after it."""
    tree = scratch_copy("sglang", version, tmp_path / "sglang", with_git=False)
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "sglang-pd-dump-path", "--tree", str(tree))
    assert code == 0, err
    lines = (tree / "sglang/srt/model_executor/model_runner.py").read_text().splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.rstrip().endswith("# rl-msprobe:sglang-pd-dump-path")]
    assert "self.msprobe_debugger = PrecisionDebugger(" in lines[at - 3] and lines[at - 1].strip() == ")"
    code, _, err = run_cli("patch", "revert", "sglang-pd-dump-path", "--tree", str(tree))
    assert code == 0, err
    assert snapshot(tree) == before


def test_pd_dump_path_refused_below_native(tmp_path):
    """Below 0.5.11 SGLang has no debugger of its own: the set names the missing site, writes nothing."""
    tree = scratch_copy("sglang", "0.5.10.post1", tmp_path / "sglang", with_git=False)
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "sglang-pd-dump-path", "--tree", str(tree))
    assert code == 2 and "self.msprobe_debugger" in err, err
    assert snapshot(tree) == before

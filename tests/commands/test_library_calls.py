"""Every command's main operation called from Python, without click: the frozen result, its enum
verdict and its `--json` document; and the guard that keeps every click command thin (<= 40 lines).

Real inputs throughout: hand-made dump logs (correlate), real msprobe dumps of the stand-in model
(compare, positions), a triage log as the verl-triage helper writes it, a fetched verl release
(patch diff) and a launch script of the corpus (prepare, check).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from tests.dumps.conftest import (  # noqa: F401 - consistency_tree and position_dumps are fixtures
    consistency_tree,
    dispatch,
    position_dumps,
    update,
    write_dump,
    write_jsonl,
)

COMMANDS = Path(__file__).resolve().parents[2] / "rl_msprobe" / "commands"
CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "launch"
LIMIT = 40  # lines of a click command function, signature and docstring included


def _command_lengths() -> dict[str, int]:
    """`module:function` -> lines, for every function in rl_msprobe/commands decorated as a command."""
    out = {}
    for path in sorted(COMMANDS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith(".command")
                for d in node.decorator_list
            ):
                assert node.end_lineno is not None
                out[f"{path.stem}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_every_click_command_is_thin() -> None:
    lengths = _command_lengths()
    assert len(lengths) >= 15 and "dumps:compare" in lengths and "planner:prepare" in lengths, lengths
    assert {name: n for name, n in lengths.items() if n > LIMIT} == {}


def test_every_schema_is_documented() -> None:
    """Each `rl-msprobe.<command>/<n>` the package writes has its row in docs/json.md, and back."""
    import re

    pattern = re.compile(r"rl-msprobe\.[a-z-]+/\d+")
    code = {m for p in COMMANDS.parent.rglob("*.py") for m in pattern.findall(p.read_text(encoding="utf-8"))}
    docs = set(pattern.findall((COMMANDS.parents[1] / "docs" / "json.md").read_text(encoding="utf-8")))
    assert len(code) >= 15 and code == docs


def test_correlate_names_broken_input_by_kind(consistency_tree: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    from rl_msprobe.dumps.correlate import Unpaired, correlate

    rollout, train = consistency_tree  # every join case: a missing dump and a cut-short line among them
    result = correlate(rollout, train)
    assert result.pairs and not result.ok and result.to_json()["schema"] == "rl-msprobe.dumps-correlate/1"
    kinds = {u.request_id: u.kind for u in result.unmatched}
    assert kinds["eeee"] is Unpaired.MISSING_DUMP and kinds["dddd"] is Unpaired.UNPAIRED
    assert [u.kind for u in result.unmatched if u.request_id is None and "not a JSON" in u.why] == [
        Unpaired.BAD_LINE
    ]
    r, t = tmp_path / "clean" / "gen", tmp_path / "clean" / "actor"
    write_jsonl(
        r / "100" / "dispatch_log.jsonl", [dispatch(100, 0, 0, "prefill", ("aaaa-0123abcd", "new", 7))]
    )
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "aaaa"), update(300, 0, 1, "zzzz")])
    write_dump(r / "100" / "step0" / "rank0")
    write_dump(t / "300" / "step0" / "rank0")
    clean = correlate(r, t)
    assert clean.ok and len(clean.pairs) == 1 and [u.kind for u in clean.unmatched] == [Unpaired.UNPAIRED]


def test_dumps_check(tmp_path: Path) -> None:
    from rl_msprobe.dumps.api import check_dumps
    from rl_msprobe.errors import UserError

    write_dump(tmp_path / "step0" / "rank0")
    report = check_dumps([tmp_path])
    assert (
        report.ok and report.mode == "inference" and report.to_json()["schema"] == "rl-msprobe.dumps-check/1"
    )
    assert report.lines()[-1] == "layout complete"
    write_dump(tmp_path / "step1" / "rank1")
    broken = check_dumps([tmp_path], jobs=1)
    assert not broken.ok and broken.lines()[-1] == f"{len(broken.problems)} problem(s) found"
    with pytest.raises(UserError, match="one folder, or two"):
        check_dumps([tmp_path] * 3)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_compare_dumps(tmp_path: Path) -> None:
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    pytest.importorskip("transformers", reason="transformers is in the `test` extra")
    from rl_msprobe.dumps.api import CompareOptions, Verdict, compare_dumps
    from tests.support import standin_dumps

    sides = standin_dumps.build()
    said: list[str] = []
    same = compare_dumps(
        CompareOptions(sides["rollout"], sides["train"], tmp_path / "same", jobs=2), said.append
    )
    assert same.verdict is Verdict.CONSISTENT and same.ok and len(same.run.results) == 2
    assert same.report["md"].is_file() and same.lines()[-3].startswith("prompt only: CONSISTENT: 2 pair(s)")
    doc = same.to_json()
    assert doc["schema"] == "rl-msprobe.dumps-compare/1" and doc["consistent"] is True
    assert said == []  # no --limit, no recorded interpreter, no progress asked for
    one = CompareOptions(sides["rollout"], sides["train_perturbed"], tmp_path / "diff", jobs=2, limit=1)
    perturbed = compare_dumps(one, said.append)
    assert perturbed.verdict is Verdict.DIVERGENT and not perturbed.ok and len(perturbed.run.results) == 1
    assert said == ["comparing the first 1 of 2 pairs (--limit)"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        perturbed.verdict = Verdict.CONSISTENT  # type: ignore[misc]


@pytest.mark.timeout(1800)
def test_compare_positions(position_dumps: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    from rl_msprobe.dumps.api import Verdict, compare_positions
    from tests.dumps.test_positions_per_token import _job

    gen, actor = _job(tmp_path, position_dumps["stats_clean"], position_dumps["record"])
    outcome = compare_positions(gen, actor, tmp_path / "out")
    assert outcome.verdict is Verdict.CONSISTENT and outcome.ok, outcome.summary
    doc = outcome.to_json()
    assert doc["schema"] == "rl-msprobe.dumps-positions/1" and doc["status"] == "consistent"
    assert outcome.report["md"].is_file() and outcome.lines()[-1] == f"report: {outcome.report['md']}"


def test_mismatch_report(tmp_path: Path) -> None:
    from rl_msprobe.triage.api import Found, mismatch_report
    from tests.triage.test_report import SCRIPT, write_log

    write_log(tmp_path / "triage")
    script = tmp_path / "run_job.sh"
    script.write_text(SCRIPT)
    result = mismatch_report(tmp_path / "triage", script=script, python="/v/bin/python")
    assert result.found is Found.REQUEST and result.ok and result.proposal is not None
    assert result.proposal.step == 4 and Path(result.paths["md"]).is_file()
    doc = result.to_json()
    assert doc["schema"] == "rl-msprobe.mismatch-report/1" and doc["proposal"]["step"] == 4
    assert doc["report"] == result.paths and json.dumps(doc)
    assert result.lines()[0] == f"{result.triage.requests} request(s), 5 step(s) from 1 file(s)"


def test_patch_list() -> None:
    from rl_msprobe.patches.listing import list_sets

    result = list_sets()
    vllm = next(s for s in result.sets if s.name == "vllm-dump")
    assert vllm.project == "vllm" and vllm.default_release in vllm.versions
    assert result.to_json()[0]["name"] == result.sets[0].name and json.dumps(result.to_json())


def test_patch_preview(tmp_path: Path) -> None:
    from rl_msprobe.engine.preview import Pending, preview
    from tests.support.trees import scratch_copy

    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    result = preview(("verl-prompts-only",), str(tree))
    assert result.pending is Pending.CHANGES and result.summary["files"]
    doc = result.to_json()
    assert (
        doc["schema"] == "rl-msprobe.patch-diff/1"
        and doc["version"] == "0.9.1"
        and doc["diff"] == result.text
    )
    assert result.notes()[-1].startswith(f"# {result.target.describe()}: ")
    assert len(result.stat_lines()) == len(result.summary["files"])


def test_prepare_and_check(tmp_path: Path) -> None:
    from rl_msprobe.planner.api import Checked, Prepared, PrepareOptions, check_script, prepare_script

    script = tmp_path / "run_a.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    before = check_script(str(script), mode="inference")
    assert before.verdict is Checked.VIOLATED and not before.ok and before.report.result.violations
    assert before.to_json()["schema"] == "rl-msprobe.check/1"
    result = prepare_script(PrepareOptions(str(script), mode="inference", steps="0"))
    assert result.state is Prepared.WRITTEN and result.ok and result.plan is not None
    derived = Path(result.plan.derived_path)
    assert derived.is_file() and f"wrote {derived}" in result.text() and result.errors() == []
    doc = result.to_json()
    assert (
        doc["schema"] == "rl-msprobe.prepare/1" and doc["written"] is True and doc["script"] == str(derived)
    )
    after = check_script(str(derived), mode="inference")
    assert after.verdict is Checked.HOLDS and after.lines()[0] == f"{derived}: inference rules: ok"


def test_prepare_stops_when_msprobe_does_not_import(tmp_path: Path) -> None:
    from rl_msprobe.planner.api import Prepared, PrepareOptions, prepare_script
    from rl_msprobe.upstream.release_cache import cache_dir
    from tests.planner.test_env import make_venv

    bare = make_venv(cache_dir() / "venvs" / "planner-env-bare")  # the env tests' venv without msprobe

    script = tmp_path / "run_a.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    result = prepare_script(PrepareOptions(str(script), mode="inference", python=str(bare)))
    assert result.state is Prepared.MSPROBE_MISSING and result.plan is None and result.text() == ""
    assert "msprobe is not importable" in result.errors()[0] and result.to_json()["written"] is False
    assert not list(tmp_path.glob("msprobe_*"))


def test_detect(tmp_path: Path) -> None:
    from rl_msprobe.planner.api import detect_script

    script = tmp_path / "run_a.sh"
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    undecided = detect_script(str(script))
    assert (
        not undecided.ok and undecided.detection.mode == "unknown" and undecided.detection.rollout == "vllm"
    )
    decided = detect_script(str(script), hint="dump the rollout's inference")
    assert decided.ok and decided.detection.mode == "inference", decided.detection.reasons
    assert decided.to_json()["schema"] == "rl-msprobe.detect/1" and decided.lines()[0] == "mode: inference"


def test_env_without_msprobe() -> None:
    from rl_msprobe.planner.env import ensure
    from rl_msprobe.upstream.release_cache import cache_dir
    from tests.planner.test_env import make_venv

    report = ensure(str(make_venv(cache_dir() / "venvs" / "planner-env-bare")), no_install=True)
    doc = report.to_json()
    assert not report.ok and doc["schema"] == "rl-msprobe.env/1" and doc["manual_commands"]


def test_patch_status_and_apply_groups(tmp_path: Path) -> None:
    from rl_msprobe import engine
    from rl_msprobe.engine import selection
    from tests.support.trees import scratch_copy

    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    groups = selection.status_groups((), str(tree), None)
    ((target, sets),) = groups
    assert target.project == "verl" and sets and all(not s.includes for s in sets)
    statuses = [engine.status(t, s) for t, s in selection.groups(("verl-prompts-only",), str(tree), None)]
    doc = engine.combined_status_json(statuses)
    assert doc["schema"] == "rl-msprobe.patch-status/1" and not statuses[0].all_applied


def test_weights_compare(tmp_path: Path) -> None:
    from rl_msprobe.weights.api import Parity, compare_weights
    from tests.weights import synthetic

    equal = compare_weights(synthetic.write(tmp_path / "ok"))
    assert (
        equal.verdict is Parity.EQUAL
        and equal.ok
        and equal.to_json()["schema"] == "rl-msprobe.weights-compare/1"
    )
    name = "model.layers.1.mlp.down_proj.weight"
    bad = synthetic.write(tmp_path / "bad", faults=[(2, "resident", name, 1, 1.5)])
    different = compare_weights(bad, out=tmp_path / "report")
    assert different.verdict is Parity.DIFFERENT and not different.ok
    assert different.report and all(Path(p).is_file() for p in different.report)
    assert [f"wrote {p}" for p in different.report] == [
        x for x in different.lines() if x.startswith("wrote ")
    ]
    assert different.to_json()["report"] == list(different.report)


def test_patch_apply_and_revert(tmp_path: Path) -> None:
    from rl_msprobe import engine
    from rl_msprobe.engine import selection
    from tests.support.trees import scratch_copy, snapshot

    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl", with_git=False)
    before = snapshot(tree)
    groups = selection.groups(("verl-prompts-only",), str(tree), None)
    (applied,) = engine.apply_many(groups)
    assert not applied.noop and applied.changed and applied.manifest and applied.git is None
    assert engine.combined_json([applied])["schema"] == "rl-msprobe.patch-apply/1"
    (reverted,) = engine.revert_many(selection.groups(("verl-prompts-only",), str(tree), None))
    assert set(reverted.changed) == set(applied.changed)
    assert engine.combined_json([reverted])["schema"] == "rl-msprobe.patch-revert/1"
    after = snapshot(tree)
    assert {k: v for k, v in after.items() if k in before} == before


def test_env_lines_after_a_failed_install() -> None:
    """The branch no live test reaches (pip ran and msprobe still does not import): pip's last five
    lines, then the manual commands; never the --no-install line."""
    from rl_msprobe.planner.env import EnvReport

    log = "\n".join(f"pip line {n}" for n in range(8))
    report = EnvReport(
        "py3", False, error="No module named 'msprobe'", install_attempted=True, install_log=log
    )
    lines = report.lines()
    assert lines[:2] == [
        "msprobe is NOT importable in py3: No module named 'msprobe'",
        "Installing it failed; pip said:",
    ]
    assert lines[2:7] == [f"  | pip line {n}" for n in range(3, 8)] and "--no-install" not in "\n".join(lines)
    assert lines[8:10] == ["Manual commands:", "  py3 -m pip install mindstudio-probe"]

"""Capabilities per entry point: a trainer the job does not run must not block the patch.

The tree is real verl history (tests/data/history/verl.bundle, commit 7ac7839 of 2026-01-06, where
`FullyAsyncTrainer.fit` takes each batch from the queue itself and there is no `_fit_generate`).
rl-msprobe knows that shape since issue 21 (a second `Site`); to stand for a trainer shape it does
not know, these tests drop that Site, which is exactly the rl-msprobe that refused all 56 commits
of that range whole. The runtime guard is checked on the real verl 0.9.1 release in the job venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.verl_trainer import Site, VerlFullyAsyncTrainer
from rl_msprobe.errors import UserError
from rl_msprobe.patches import all_sets, entry_point_started_by, entry_points, get_entry_point
from tests.patches.test_history_sweep import before_issue_21
from tests.support.history import checkout, clone, git
from tests.support.trees import run_cli, scratch_copy

FULLY_ASYNC_FILE = "verl/experimental/fully_async_policy/fully_async_trainer.py"


@pytest.fixture
def without_fit_site(monkeypatch):
    """The fully-async codemod as it was before it knew the fit-loop shape (only `_fit_generate`)."""
    before_issue_21(monkeypatch)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return clone("verl", tmp_path_factory.mktemp("history") / "verl")


@pytest.fixture
def fit_shape_tree(bundle) -> Path:
    checkout(bundle, "7ac7839")
    return bundle


def test_every_piece_names_entry_points_of_its_project():
    names = {(e.project, e.name) for e in entry_points("verl")}
    assert len(names) >= 4
    for patch_set in all_sets():
        for piece in patch_set.all_pieces():
            assert all((e.project, e.name) in names for e in piece.runs_in), (patch_set.name, piece.label)
    with pytest.raises(UserError, match="main_ppo, main_ppo_sync"):
        get_entry_point("verl", "main_pp")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("verl.trainer.main_ppo", "main_ppo"),
        ("verl/trainer/main_ppo.py", "main_ppo"),
        ("verl.trainer.main_ppo_sync", "main_ppo_sync"),
        ("verl.experimental.fully_async_policy.fully_async_main", "fully_async"),
        ("/src/verl/experimental/one_step_off_policy/main_ppo.py", "one_step_off"),
        ("recipe.dapo.main_dapo", None),  # a recipe's own main: rl-msprobe cannot tell its trainer
    ],
)
def test_launch_entry_names_its_entry_point(entry, expected):
    found = entry_point_started_by("verl", entry)
    assert (found.name if found else None) == expected


def test_apply_patches_the_rest_and_names_the_trainer_without_a_site(fit_shape_tree, without_fit_site):
    tree = fit_shape_tree
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert FULLY_ASYNC_FILE in doc["changed"] and "verl/trainer/ppo/ray_trainer.py" in doc["changed"]
    (gap,) = doc["not_covered"]
    assert gap["entry_point"] == "fully_async" and gap["piece"] == "verl-fully-async-trainer"
    assert gap["path"] == FULLY_ASYNC_FILE and gap["in_tree"] is True
    assert "anchor 'FullyAsyncTrainer._fit_generate' not found (detected version 0.7.0.dev)" in gap["reason"]
    assert doc["entry_points"]["main_ppo"] is True and doc["entry_points"]["fully_async"] is False
    guard = [line for line in (tree / FULLY_ASYNC_FILE).read_text().splitlines() if ".not_covered(" in line]
    assert len(guard) == 1 and "FullyAsyncTrainer, '__init__'" in guard[0] and "('PROMPTS_ONLY',)" in guard[0]

    code, out, err = run_cli("patch", "status", "verl-consistency", "--tree", str(tree))
    assert code == 0, out
    assert "verl-consistency: applied" in out
    assert "NOT COVERED for fully_async: verl-consistency: capability 'PROMPTS_ONLY trim'" in out
    assert "fully_async (NOT covered)" in out and "main_ppo (covered)" in out
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    (entry,) = json.loads(out)["sets"]
    assert [g["piece"] for g in entry["not_covered"]] == ["verl-fully-async-trainer"]
    assert {f["codemod"]: f["status"] for f in entry["files"]}["verl-fully-async-trainer"] == "not-covered"

    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree))
    assert code == 0 and "already applied" in out and "NOT COVERED for fully_async" in out
    assert "warning: not covered: fully_async" in err

    code, out, err = run_cli("patch", "revert", "verl-consistency", "--tree", str(tree))
    assert code == 0, err
    assert git(tree, "diff", "7ac7839", "--stat") == ""


def test_for_entry_point_refuses_only_what_it_runs(fit_shape_tree, without_fit_site):
    tree = fit_shape_tree
    head = git(tree, "rev-parse", "HEAD")
    code, out, err = run_cli(
        "patch", "apply", "verl-consistency", "--for", "fully_async", "--tree", str(tree)
    )
    assert code == 2
    for words in (
        FULLY_ASYNC_FILE,
        "'FullyAsyncTrainer._fit_generate'",
        "0.7.0.dev",
        "update it",
        "Nothing was changed",
    ):
        assert words in err, (words, err)
    assert git(tree, "rev-parse", "HEAD") == head and git(tree, "status", "--porcelain") == ""

    code, out, err = run_cli(
        "patch", "apply", "verl-consistency", "--for", "main_ppo", "--tree", str(tree), "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["entry_point"] == "main_ppo" and doc["entry_points"]["main_ppo"] is True
    assert [g["entry_point"] for g in doc["not_covered"]] == ["fully_async"]  # still said, never silent
    run_cli("patch", "revert", "verl-consistency", "--tree", str(tree))

    code, _, err = run_cli(
        "patch", "apply", "verl-consistency", "--for", "main_ppo_sync", "--tree", str(tree)
    )
    assert code == 2 and "not in this tree" in err and "verl/trainer/main_ppo_sync.py" in err
    code, _, err = run_cli("patch", "apply", "verl-consistency", "--for", "nope", "--tree", str(tree))
    assert code == 2 and "known: main_ppo" in err


def test_a_newer_rl_msprobe_replaces_the_guard_with_the_site(fit_shape_tree, monkeypatch):
    tree = fit_shape_tree
    with monkeypatch.context() as older:
        before_issue_21(older)
        code, _, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree))
        assert code == 0 and "NOT COVERED for fully_async" in _, err
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    files = {f["codemod"]: f for f in json.loads(out)["sets"][0]["files"]}
    assert files["verl-fully-async-trainer"]["status"] == "partial"
    assert "apply again" in files["verl-fully-async-trainer"]["detail"]
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["changed"] == [FULLY_ASYNC_FILE] and doc["not_covered"] == []
    assert doc["entry_points"]["fully_async"] is True
    text = (tree / FULLY_ASYNC_FILE).read_text()
    assert ".not_covered(" not in text and "prompts_forward(self, batch)" in text
    code, out, _ = run_cli("patch", "status", "verl-consistency", "--tree", str(tree))
    assert code == 0 and "NOT COVERED" not in out
    run_cli("patch", "revert", "verl-consistency", "--tree", str(tree))
    assert git(tree, "diff", "7ac7839", "--stat") == ""


# The guard at run time: the real verl 0.9.1 FullyAsyncTrainer (a @ray.remote class) in the job venv.
# One verl import for both runs: the guard reads PROMPTS_ONLY when the method runs, so the script
# calls it with the switch on, then off (argv: the values, "" for unset).
GUARD_SCRIPT = r"""
import asyncio, json, os, sys
from verl.experimental.fully_async_policy import fully_async_trainer as m
cls = m.FullyAsyncTrainer.__ray_metadata__.modified_class.__ray_actor_class__
for value in sys.argv[1:]:
    os.environ.pop("PROMPTS_ONLY", None)
    if value:
        os.environ["PROMPTS_ONLY"] = value
    try:
        asyncio.run(cls._fit_generate(object()))
        print("GUARD:" + json.dumps({"raised": None}))
    except Exception as exc:
        print("GUARD:" + json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
"""


@pytest.mark.e2e
@pytest.mark.release
def test_a_trainer_without_its_site_fails_at_run_time(tmp_path, monkeypatch):
    """Wall time 24-30 s on the loaded 2-core box (a verl 0.9.1 copy patched, one verl import for both
    runs: PROMPTS_ONLY=1, then unset)."""
    from tests.support import verl_venv

    python = verl_venv.venv_python_or_skip()
    tree = scratch_copy("verl", "0.9.1", tmp_path / "verl-0.9.1")
    never = matchers.calls("self.rl_msprobe_no_such_call")  # a shape rl-msprobe does not know
    unknown = tuple(Site(site.method, never, True) for site in VerlFullyAsyncTrainer.sites)
    monkeypatch.setattr(VerlFullyAsyncTrainer, "sites", unknown)
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    assert [g["entry_point"] for g in json.loads(out)["not_covered"]] == ["fully_async"]

    environ = {k: v for k, v in os.environ.items() if k not in ("PROMPTS_ONLY", "DUMP_ON")}
    environ.update(PYTHONPATH=str(tree))
    done = subprocess.run(
        [str(python), "-c", GUARD_SCRIPT, "1", ""], env=environ, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refused, plain = (json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("GUARD:"))
    assert refused["raised"] == "RuntimeError", refused
    for words in (
        "FullyAsyncTrainer._fit_generate",
        "verl-fully-async-trainer",
        "PROMPTS_ONLY=1",
        "patch status",
    ):
        assert words in refused["message"], (words, refused)
    # collection off: upstream's own code runs (and fails on the stand-in self)
    assert plain["raised"] not in (None, "RuntimeError"), plain


def test_apply_help_and_docs_name_every_entry_point():
    """The four names are written out in `patch apply --help` and the patch guide's entry-point
    table (docs/commands/patch.md): they must stay the registry's."""
    code, out, _ = run_cli("patch", "apply", "--help")
    guide = (Path(__file__).resolve().parents[2] / "docs" / "commands" / "patch.md").read_text()
    for entry in entry_points("verl"):
        assert entry.name in " ".join(out.split()) and f"| `{entry.name}` |" in guide, entry.name

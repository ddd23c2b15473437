"""Sets that share pieces (a helper file, an included set's codemods): reverting one keeps what another
applied set still uses (reference counting), and reverting the last gives back the original bytes.

Trees: the files of these sets from the real verl 0.9.1 release, as git repos in tmp dirs or plain
folders. Shared today: verl-prompts-only and verl-request-id both add verl/utils/rl_msprobe_consistency.py;
verl-consistency includes verl-engine (and those two), so it shares every piece with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_msprobe.patches import get_set
from tests.support.trees import git, release_subset, run_cli, snapshot

pytestmark = pytest.mark.release
PAIRS = [("verl-prompts-only", "verl-request-id"), ("verl-engine", "verl-consistency")]
CASES = [  # (A, B, git?): each pair on git and plain trees, kept lean (LibCST on verl's trainer is slow)
    (*PAIRS[0], True),
    (*PAIRS[0], False),
    (*PAIRS[1], True),
    (PAIRS[1][1], PAIRS[1][0], False),
]


def _tree(tmp_path: Path, names: tuple[str, ...], with_git: bool) -> Path:
    sets = [get_set(n) for n in names]
    paths = {p.path for s in sets for p in s.all_pieces()}
    paths |= {c.probe.path for s in sets for c in s.all_capabilities() if c.probe}
    return release_subset("verl", "0.9.1", tmp_path / "verl", sorted(paths), with_git=with_git)


def _cli(verb: str, tree: Path, *names: str) -> dict:
    code, out, err = run_cli("patch", verb, *names, "--tree", str(tree), "--json")
    assert code == 0, err
    return json.loads(out)


def _status(tree: Path, *names: str) -> dict[str, str]:
    _, out, _ = run_cli("patch", "status", *names, "--tree", str(tree), "--json")
    return {s["name"]: s["status"] for s in json.loads(out)["sets"]}


def _works(tree: Path, name: str) -> None:
    """Every file of the set is there and compiles (the patched lines import the set's helper files)."""
    for piece in get_set(name).all_pieces():
        path = tree / piece.path
        if path.exists():
            compile(path.read_bytes(), str(path), "exec")
    assert _status(tree, name) == {name: "applied"}


@pytest.mark.parametrize(("a", "b", "with_git"), CASES, ids=lambda v: {True: "git", False: "plain"}.get(v, v))
def test_reverting_one_set_keeps_the_pieces_the_other_uses(
    tmp_path: Path, a: str, b: str, with_git: bool
) -> None:
    tree = _tree(tmp_path, (a, b), with_git)
    before = snapshot(tree)
    _cli("apply", tree, a, b)
    reverted = _cli("revert", tree, b)
    assert reverted["kept"] and {k["detail"] for k in reverted["kept"]} == {f"still used by {a}"}
    _works(tree, a)
    assert _cli("apply", tree, a)["noop"] is True  # nothing was missing
    _cli("revert", tree, a)
    assert snapshot(tree) == before
    assert set(_status(tree, a, b).values()) == {"absent"}
    if with_git:
        assert git(tree, "status", "--porcelain") == ""


def test_git_apply_a_apply_b_revert_b_apply_a_ends_applied(tmp_path: Path) -> None:
    """Reported: the second `apply A` met A's own branch (a missing shared piece made it a real apply) and
    A stayed partial."""
    a, b = PAIRS[0]
    tree = _tree(tmp_path, (a, b), with_git=True)
    _cli("apply", tree, a)
    _cli("apply", tree, b)
    _cli("revert", tree, b)
    code, _, err = run_cli("patch", "apply", a, "--tree", str(tree))
    assert code == 0, err
    assert _status(tree, a) == {a: "applied"}


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_applying_a_set_another_already_brought_records_it(tmp_path: Path, kind: str) -> None:
    """verl-engine after verl-consistency changes no file but is recorded (git: an empty commit), so
    reverting verl-consistency keeps the engine hooks; reverting verl-engine then restores every byte."""
    tree = _tree(tmp_path, ("verl-consistency",), kind == "git")
    before = snapshot(tree)
    _cli("apply", tree, "verl-consistency")
    engine = _cli("apply", tree, "verl-engine")
    assert engine["noop"] is True and (engine["git"] is not None) == (kind == "git")
    _cli("revert", tree, "verl-consistency")
    _works(tree, "verl-engine")
    assert _status(tree, "verl-prompts-only", "verl-request-id") == {
        "verl-prompts-only": "absent",
        "verl-request-id": "absent",
    }
    _cli("revert", tree, "verl-engine")
    assert snapshot(tree) == before
    if kind == "git":
        assert "rl-msprobe: revert verl-engine" in git(tree, "log", "-1", "--format=%s")


def test_revert_of_a_set_whose_pieces_all_stay_drops_it_from_the_record(tmp_path: Path) -> None:
    """Reverting verl-engine while verl-consistency is applied changes no file (consistency needs every
    engine piece), says so, and forgets verl-engine: reverting verl-consistency then removes everything."""
    tree = _tree(tmp_path, ("verl-consistency",), with_git=False)
    before = snapshot(tree)
    _cli("apply", tree, "verl-consistency", "verl-engine")
    code, out, err = run_cli("patch", "revert", "verl-engine", "--tree", str(tree))
    assert code == 0, err
    assert "no file changed" in out and "kept: verl/utils/rl_msprobe_hooks.py" in out, out
    assert "still used by verl-consistency" in out
    _cli("revert", tree, "verl-consistency")
    assert snapshot(tree) == before


def test_a_manifest_with_a_bad_record_exit_2(tmp_path: Path) -> None:
    tree = _tree(tmp_path, ("verl-engine",), with_git=False)
    _cli("apply", tree, "verl-engine")
    manifest = tree / ".rl-msprobe" / "manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "applied": "verl-engine"}))
    code, _, err = run_cli("patch", "revert", "verl-engine", "--tree", str(tree))
    assert code == 2 and '"applied"' in err and str(manifest) in err, err


def test_a_recorded_set_this_version_does_not_know_is_ignored(tmp_path: Path) -> None:
    """A record written by another rl-msprobe version may name a set that no longer exists."""
    tree = _tree(tmp_path, ("verl-engine",), with_git=False)
    before = snapshot(tree)
    _cli("apply", tree, "verl-engine")
    manifest = tree / ".rl-msprobe" / "manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "applied": ["verl-old-name", "verl-engine"]}))
    _cli("revert", tree, "verl-engine")
    assert snapshot(tree) == before

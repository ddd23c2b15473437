"""Every codemod of every registered patch set, run over its own fixture folder
(`fixtures/codemods/<codemod>/`, `Codemod.fixture_folder`), the way Fixit runs each rule's own
valid and invalid cases: exact output, idempotent, byte-exact revert (CRLF too), output parses
and compiles, status absent / applied / partial, the diff passes `git apply --check` against the
before file, and every `*.invalid.py` drift fails loudly naming the file and the anchor.

Adding a new upstream shape to a codemod = one X.before.py / X.after.py pair here (and the
variant in the codemod); nothing else to register.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.engine import FileChange, unified_diff
from rl_msprobe.patches import all_sets
from tests.support.codemod_cases import FIXTURES, check_invalid, check_pair, invalid, pairs

# codemods whose cases are not written yet (each a gap to close, not a pass)
WITHOUT_FIXTURES: dict[str, str] = {}


def _registered() -> list[Codemod]:
    found: dict[str, Codemod] = {}
    for patch_set in all_sets():
        for piece in patch_set.all_pieces():
            if isinstance(piece.item, Codemod):
                found.setdefault(piece.item.name, piece.item)
    return sorted(found.values(), key=lambda c: c.name)


CODEMODS = _registered()


def _pair_params() -> list:
    return [
        pytest.param(codemod, before, after, id=f"{codemod.name}:{before.name}")
        for codemod in CODEMODS
        if codemod.name not in WITHOUT_FIXTURES
        for before, after in pairs(codemod.fixture_folder)
    ]


def _invalid_params() -> list:
    return [
        pytest.param(codemod, path, id=f"{codemod.name}:{path.name}")
        for codemod in CODEMODS
        for path in invalid(codemod.fixture_folder)
    ]


@pytest.mark.parametrize(
    "codemod",
    [
        pytest.param(c, id=c.name, marks=pytest.mark.xfail(reason=WITHOUT_FIXTURES[c.name], strict=True))
        if c.name in WITHOUT_FIXTURES
        else pytest.param(c, id=c.name)
        for c in CODEMODS
    ],
)
def test_every_codemod_has_its_own_fixture_folder(codemod: Codemod) -> None:
    folder = FIXTURES / codemod.fixture_folder
    assert folder.is_dir(), f"{codemod.name}: no fixture folder {folder}"
    assert list(folder.glob("*.before.py")), f"{codemod.name}: no X.before.py / X.after.py case in {folder}"


def test_no_fixture_folder_without_a_codemod() -> None:
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= {c.fixture_folder for c in CODEMODS}, folders - {c.fixture_folder for c in CODEMODS}


@pytest.mark.parametrize(("codemod", "before", "after"), _pair_params())
def test_fixture_pair(codemod: Codemod, before: Path, after: Path) -> None:
    check_pair(codemod, before, after)


@pytest.mark.parametrize(("codemod", "before", "after"), _pair_params())
def test_the_diff_applies_with_git(codemod: Codemod, before: Path, after: Path, tmp_path: Path) -> None:
    """The diff rl-msprobe prints for the case is one `git apply --check` accepts on the before file."""
    source = before.read_bytes()
    tree = tmp_path / "tree"
    (tree / codemod.path).parent.mkdir(parents=True)
    (tree / codemod.path).write_bytes(source)
    diff = unified_diff([FileChange(codemod.path, source, codemod.apply(source.decode()).encode())])
    (tmp_path / "change.diff").write_text(diff)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    proc = subprocess.run(
        ["git", "-C", str(tree), "apply", "--check", str(tmp_path / "change.diff")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("codemod", "path"), _invalid_params())
def test_drifted_source_fails_loudly(codemod: Codemod, path: Path) -> None:
    check_invalid(codemod, path)

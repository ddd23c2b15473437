"""The tests mirror the source (docs/testing.md, "Where a test lives"): a test module sits under a
folder named for the rl_msprobe package it tests, or is `tests/test_<module>.py` for a top-level
module, so the test of a module is found by its path. Live jobs, the harness and the docs checks
have folders of their own; anything else is named here with the reason."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN_FOLDERS = ("live", "support", "docs", "data")  # live jobs by tier marker, the harness, docs shape, inputs

# test module (relative to tests/) -> why it does not sit under an rl_msprobe package; keep it small
ALLOWED: dict[str, str] = {
    "test_layering.py": "the import rules of the whole package (docs/architecture.md), no one module's",
    "test_hostile_inputs.py": "hostile inputs through every command's CLI (engine, weights, dumps, triage, "
    "launch): issue 45's table, case by case, no one package's",
}


def misplaced(tests: Path, source: Path, allowed: dict[str, str]) -> list[str]:
    """The test modules under TESTS that no folder or module of SOURCE accounts for, and the
    ALLOWED entries that name no test module (a stale reason hides the next misplaced one)."""
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] in OWN_FOLDERS or rel.as_posix() in allowed:
            continue
        folder = rel.parent
        if folder == Path("."):
            ok = (source / f"{path.stem.removeprefix('test_')}.py").is_file()
        else:
            ok = (source / folder).is_dir()
        if not ok:
            wrong.append(rel.as_posix())
    wrong += [f"{name} (allowed, but not there)" for name in allowed if not (tests / name).is_file()]
    return wrong


def test_every_test_module_sits_under_the_package_it_tests():
    wrong = misplaced(ROOT / "tests", ROOT / "rl_msprobe", ALLOWED)
    assert not wrong, (
        "move these under tests/<package>/ for the rl_msprobe package they test "
        "(or name them in ALLOWED with the reason):\n" + "\n".join(wrong)
    )


def test_the_check_finds_a_catch_all_folder_and_a_stale_allowance(tmp_path: Path):
    source, tests = tmp_path / "rl_msprobe", tmp_path / "tests"
    for name in ("engine/gitstate.py", "cli.py"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("")
    for name in (
        "engine/test_gitstate.py",
        "test_cli.py",
        "core/test_git_states.py",
        "test_misc.py",
        "live/test_job.py",
    ):
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text("")
    assert misplaced(tests, source, {}) == ["core/test_git_states.py", "test_misc.py"]
    assert misplaced(tests, source, {"test_misc.py": "a reason", "gone/test_x.py": "a reason"}) == [
        "core/test_git_states.py",
        "gone/test_x.py (allowed, but not there)",
    ]

"""The real upstream history of the patched files, commit by commit (bundles in tests/data/history).

For verl main since the v0.6.0 branch point and vLLM-Ascend main since v0.12.0rc1: every commit
whose change can matter to a codemod (a patched file or top-level class added or removed, the
version changed, an anchor line changed: `tests.support.history.anchor_commits`), plus the
newest commits and the named ones below, goes through the full cycle in-process (diff, apply with
branch + commit, status applied, second apply a no-op, byte-exact revert) with every capability
patched — or is refused, for the reason committed in REFUSALS, and only there.

Codemods are pure str -> str, so each distinct (codemod, file text) is run once per session.
"""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.errors import UserError
from tests.support.history import anchor_commits, checkout, clone, commits, full_cycle

pytestmark = [pytest.mark.release, pytest.mark.history]

LLM_SERVER = "verl/workers/rollout/llm_server.py"

# project -> (sets for every commit, sets where a refusal is expected)
SETS = {
    "verl": (["verl-consistency"], ["verl-engine", "verl-prompts-only", "verl-request-id"]),
    "vllm-ascend": (["vllm-ascend-dispatch-log"], []),
}

# project -> (first commit that is not refused, the words the refusal must hold, why). Short on purpose:
# only code that truly lacks a capability is refused.
REFUSALS = {
    "verl": (
        "cf1371f",  # 2025-11-24 "[trainer] feat: refactor workers with model engine (#4211)"
        ("capability 'engine runs the actor'", "verl/workers/engine_workers.py"),
        "before it the actor always runs the legacy workers, so the engine hook would never dump it "
        "(the parts verl-engine, verl-prompts-only and verl-request-id still apply and are cycled instead)",
    ),
}


@pytest.fixture(scope="module")
def memo_codemods():
    """Run each (codemod, text, version) once: the sweep revisits the same file texts many times."""
    original = Codemod._apply_clean
    cache: dict[tuple, tuple[bool, object]] = {}

    def apply_clean(self, source, version):
        key = (type(self), source, version)
        if key not in cache:
            try:
                cache[key] = (True, original(self, source, version))
            except UserError as exc:
                cache[key] = (False, exc)
        ok, value = cache[key]
        if ok:
            return value
        raise value

    Codemod._apply_clean = apply_clean
    yield
    Codemod._apply_clean = original


@pytest.mark.parametrize("project", sorted(SETS))
def test_every_anchor_commit_is_patched_or_refused_for_its_reason(project, tmp_path, memo_codemods):
    repo = clone(project, tmp_path / project)
    history = commits(repo)
    picked = {c.sha for c in anchor_commits(repo, project, history)}
    picked |= {c.sha for c in history[-5:]}  # always the newest
    if project == "verl":  # the silent gap of issue 10: main of 2026-04-30 (0.8.0.dev) between two clients
        picked.add([c for c in history if c.date <= "2026-04-30"][-1].sha)
    sets, fallback = SETS[project]
    first_ok, words, _ = REFUSALS.get(project, ("", (), ""))
    refusing = bool(first_ok)
    results = {}
    for commit in history:
        refusing = refusing and not commit.sha.startswith(first_ok)
        if commit.sha not in picked:
            continue
        checkout(repo, commit.sha)
        if refusing:
            with pytest.raises(UserError) as info:
                full_cycle(repo, project, sets)
            assert all(w in str(info.value) for w in words), (commit, str(info.value))
            results[commit.sha] = full_cycle(repo, project, fallback)
        else:
            try:
                results[commit.sha] = full_cycle(repo, project, sets)
            except UserError as exc:
                pytest.fail(f"{project} {commit.sha[:9]} {commit.date} {commit.subject}: {exc}")
        assert all(results[commit.sha]["capabilities"].values()), (commit, results[commit.sha])
    assert len(results) == len(picked) and len(picked) >= 20
    newest = results[history[-1].sha]
    assert newest["tested"] is False  # main is not a tested release
    if project == "verl":
        assert newest["version"] == "0.10.0.dev"
        gap = results[[c for c in history if c.date <= "2026-04-30"][-1].sha]
        assert gap["version"] == "0.8.0.dev" and gap["capabilities"]["request-id record"] == [LLM_SERVER]

"""The real upstream history of the patched files, commit by commit (bundles in tests/data/history).

For verl main since the v0.6.0 branch point and vLLM-Ascend main since v0.12.0rc1: every commit
whose change can matter to a codemod (a patched file or top-level class added or removed, the
version changed, an anchor line changed: `tests.support.history.anchor_commits`), plus the
newest commits and the named ones below, goes through the full cycle in-process (diff, apply with
branch + commit, status applied, second apply a no-op, byte-exact revert) with every capability
patched — or is refused, for the reason committed in REFUSALS, and only there (where the sets
that do apply are cycled instead).

Codemods are pure str -> str, so each distinct (codemod, file text) is run once per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.errors import UserError
from tests.support.history import Commit, anchor_commits, checkout, clone, commits, full_cycle

pytestmark = [pytest.mark.release, pytest.mark.history]

LLM_SERVER = "verl/workers/rollout/llm_server.py"

SETS = {"verl": ["verl-consistency"], "vllm-ascend": ["vllm-ascend-dispatch-log"]}


@dataclass(frozen=True)
class Refusal:
    """Commits from `first` up to (not including) `until` are refused, with `words` in the message;
    the sets in `instead` (what does apply there) are cycled on them."""

    first: str
    until: str
    words: tuple[str, ...]
    instead: tuple[str, ...]
    why: str


# Short on purpose: only code that truly lacks a capability (or holds a trainer no codemod knows).
# verl main 7ac7839 … 0e583d1 (#4795 … #5184), where FullyAsyncTrainer.fit took the batch from the
# queue itself, was refused here until verl-fully-async-trainer got that shape as a second Site.
REFUSALS = {
    "verl": (
        Refusal(
            "",  # from the v0.6.0 branch point
            "cf1371f",  # 2025-11-24 "[trainer] feat: refactor workers with model engine (#4211)"
            ("capability 'engine runs the actor'", "verl/workers/engine_workers.py"),
            ("verl-engine", "verl-prompts-only", "verl-request-id"),
            "no engine ActorRolloutRefWorker yet: the actor always runs the legacy workers, so the engine hook "
            "would never dump it",
        ),
    ),
}


def _refusal(project: str, history: list[Commit], index: int) -> Refusal | None:
    shas = [c.sha for c in history]
    for refusal in REFUSALS.get(project, ()):
        low = 0 if not refusal.first else next(i for i, s in enumerate(shas) if s.startswith(refusal.first))
        high = next(i for i, s in enumerate(shas) if s.startswith(refusal.until))
        if low <= index < high:
            return refusal
    return None


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
    results = {}
    for index, commit in enumerate(history):
        if commit.sha not in picked:
            continue
        checkout(repo, commit.sha)
        refusal = _refusal(project, history, index)
        if refusal:
            with pytest.raises(UserError) as info:
                full_cycle(repo, project, SETS[project])
            assert all(w in str(info.value) for w in refusal.words), (commit, str(info.value))
            results[commit.sha] = full_cycle(repo, project, list(refusal.instead))
        else:
            try:
                results[commit.sha] = full_cycle(repo, project, SETS[project])
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

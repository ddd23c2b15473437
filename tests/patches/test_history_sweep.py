"""The real upstream history of the patched files, commit by commit (bundles in tests/data/history).

For verl main since the v0.6.0 branch point and vLLM-Ascend main since v0.12.0rc1: every commit
whose change can matter to a codemod (a patched file or top-level class added or removed, the
version changed, an anchor line changed: `tests.support.history.anchor_commits`), plus the
newest commits and the named ones below, goes through the full cycle in-process (diff, apply with
branch + commit, status applied, second apply a no-op, byte-exact revert) with every capability
patched — or is refused, for the reason committed in REFUSALS, and only there (where the sets
that do apply are cycled instead).

Capabilities per entry point (issue 25): on verl every such commit from the engine refactor
(cf1371f, 2025-11-24; so every commit since v0.7.0) is cycled with `--for main_ppo`, which
must get every capability it needs; a trainer or rollout path whose code has no site there is
reported by name (apply, status) and refuses exactly the entry points that run it. The second
test replays the drift of issue 21 (the 56 commits 7ac7839 … 0e583d1 where `FullyAsyncTrainer.fit`
takes the batch itself) with the fully-async codemod as it was then (only `_fit_generate`):
`main_ppo` is patched on every one, `fully_async` is refused naming that anchor.

Codemods are pure str -> str, so each distinct (codemod, file text) is run once per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.codemods.verl_trainer import VerlFullyAsyncTrainer
from rl_msprobe.engine.coverage import require_entry
from rl_msprobe.errors import UserError
from rl_msprobe.patches import entry_points
from tests.support.history import Commit, anchor_commits, checkout, clone, commits, full_cycle

pytestmark = [pytest.mark.release, pytest.mark.history, pytest.mark.full]  # the full tier

LLM_SERVER = "verl/workers/rollout/llm_server.py"

SETS = {"verl": ["verl-consistency"], "vllm-ascend": ["vllm-ascend-dispatch-log"]}
ENTRY = {"verl": "main_ppo"}  # the entry point every commit must get everything for (`--for`)


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
        key = (type(self), source, version, id(getattr(type(self), "sites", None)), id(type(self).anchors))
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
                results[commit.sha] = full_cycle(repo, project, SETS[project], ENTRY.get(project))
            except UserError as exc:
                pytest.fail(f"{project} {commit.sha[:9]} {commit.date} {commit.subject}: {exc}")
            _check_entry_points(project, results[commit.sha])
        assert all(results[commit.sha]["capabilities"].values()), (commit, results[commit.sha])
    assert len(results) == len(picked) and len(picked) >= 20
    newest = results[history[-1].sha]
    assert newest["tested"] is False  # main is not a tested release
    if project == "verl":
        assert newest["version"] == "0.10.0.dev"
        gap = results[[c for c in history if c.date <= "2026-04-30"][-1].sha]
        assert gap["version"] == "0.8.0.dev" and gap["capabilities"]["request-id record"] == [LLM_SERVER]


def _check_entry_points(project: str, result: dict) -> None:
    """Each entry point the commit does not cover is refused by `--for` naming every gap's file and
    anchor; the others pass. A gap never goes unreported (full_cycle checks apply and status)."""
    for entry in entry_points(project):
        gaps = [m for m in result["all_not_covered"] if m.entry_point == entry.name]
        assert result["entry_points"][entry.name] == (not gaps)
        if not gaps:
            require_entry(entry.name, result["all_not_covered"], result["describe"])
            continue
        with pytest.raises(UserError) as info:
            require_entry(entry.name, result["all_not_covered"], result["describe"])
        for gap in gaps:
            assert gap.path in str(info.value) and gap.reason.split(";")[0] in str(info.value)


# The drift of issue 21, replayed: the fully-async codemod with only its first Site (_fit_generate).
def before_issue_21(monkeypatch) -> None:
    """VerlFullyAsyncTrainer as it was before it knew the fit-loop shape: one Site, no `fit` anchor."""
    anchors = {k: v for k, v in VerlFullyAsyncTrainer.anchors.items() if k != "FullyAsyncTrainer.fit"}
    monkeypatch.setattr(VerlFullyAsyncTrainer, "sites", VerlFullyAsyncTrainer.sites[:1])
    monkeypatch.setattr(VerlFullyAsyncTrainer, "anchors", anchors)


FIT_SHAPE = ("7ac7839", "0e583d1")  # FullyAsyncTrainer.fit takes the batch from the queue itself


def test_a_fully_async_trainer_without_its_site_blocks_only_fully_async(tmp_path, memo_codemods, monkeypatch):
    """Wall time 46-65 s alone on the loaded 2-core box, 8 s after the verl sweep (shared memo) (the
    anchor commits of 7ac7839 … 0e583d1 and three on each side, full cycle each; the whole file:
    verl 115-196 s, vLLM-Ascend 48-104 s)."""
    before_issue_21(monkeypatch)
    repo = clone("verl", tmp_path / "verl")
    history = commits(repo)
    shas = [c.sha for c in history]
    first = next(i for i, s in enumerate(shas) if s.startswith(FIT_SHAPE[0]))
    until = next(i for i, s in enumerate(shas) if s.startswith(FIT_SHAPE[1]))
    picked = {c.sha for c in anchor_commits(repo, "verl", history)} | {shas[first], shas[until - 1]}
    window = [i for i in range(first - 3, until + 3) if shas[i] in picked or i < first or i >= until]
    refused = []
    for index in window:
        checkout(repo, shas[index])
        result = full_cycle(repo, "verl", ["verl-consistency"], "main_ppo")  # main_ppo: every capability
        _check_entry_points("verl", result)
        gaps = [(m.entry_point, m.piece) for m in result["not_covered"]]
        if first <= index < until:
            assert gaps == [("fully_async", "verl-fully-async-trainer")], (history[index], gaps)
            (gap,) = result["not_covered"]
            assert "anchor 'FullyAsyncTrainer._fit_generate' not found (detected version" in gap.reason
            with pytest.raises(
                UserError, match="fully_async: verl-consistency capability 'PROMPTS_ONLY trim'"
            ):
                full_cycle(repo, "verl", ["verl-consistency"], "fully_async")
            refused.append(shas[index])
        else:  # before: no fully-async trainer in verl yet; after: _fit_generate, patched
            assert gaps == [] and (index < first or result["entry_points"]["fully_async"]), (
                history[index],
                gaps,
            )
    assert len(refused) >= 5 and shas[first] in refused and shas[until - 1] in refused

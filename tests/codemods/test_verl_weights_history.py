"""verl-weights-sent over the real upstream history of verl/workers/engine_workers.py (the verl
bundle of tests/data/history): every commit whose change touches a line with
`get_per_tensor_param` or a top-level class, plus the newest ones. Where the file defines
ActorRolloutRefWorker the codemod must apply (every anchor found), compile, be idempotent and
revert byte-exactly; where the worker does not exist yet it is not the codemod's subject.

The received side (verl/workers/rollout/vllm_rollout/utils.py, not in the verl bundle) walks its
own small bundle, tests/data/history/verl-vllm-rollout-utils.bundle (see the README there).
"""

from __future__ import annotations

import subprocess

import pytest

from rl_msprobe.codemods.base import Status
from rl_msprobe.codemods.verl_weights import VerlWeightsReceived, VerlWeightsSent
from rl_msprobe.errors import UserError
from tests.support.history import DATA, clone, commits, git

pytestmark = [pytest.mark.release, pytest.mark.history, pytest.mark.full]  # the full tier

PATH = "verl/workers/engine_workers.py"


def _picked(repo, history) -> list[str]:
    log = git(repo, "log", "--first-parent", "-p", "-U0", "--format=@@@ %H", "main", "--", PATH)
    picked, sha = set(), ""
    for line in log.splitlines():
        if line.startswith("@@@ "):
            sha = line[4:]
        elif line.startswith(("new file mode", "deleted file mode")):
            picked.add(sha)
        elif line[:1] in "+-" and not line.startswith(("+++", "---")):
            text = line[1:].strip()
            if text.startswith("class ") or "get_per_tensor_param" in text:
                picked.add(sha)
    picked |= {c.sha for c in history[-5:]}
    return [c.sha for c in history if c.sha in picked]


def test_sent_codemod_over_the_history_of_engine_workers(tmp_path):
    repo = clone("verl", tmp_path / "verl")
    history = commits(repo)
    codemod = VerlWeightsSent()
    patched = subject_free = 0
    texts: set[str] = set()
    for sha in _picked(repo, history):
        source = subprocess.run(["git", "show", f"{sha}:{PATH}"], cwd=repo, capture_output=True, text=True)
        if source.returncode != 0 or source.stdout in texts:
            continue  # the file is not there yet, or the same text was checked already
        text = source.stdout
        texts.add(text)
        if not codemod.present(text):
            subject_free += 1
            continue
        result = codemod.apply(text)  # raises, naming the anchor, where a site is missing
        assert codemod.apply(result) == result and codemod.revert(result) == text, sha
        assert codemod.status(result).status is Status.APPLIED
        assert "rl_msprobe_weights.sent(" in result
        compile(result, PATH, "exec")
        patched += 1
    assert patched >= 5, (patched, subject_free)


def test_the_sweep_is_not_vacuous(tmp_path):
    """Many distinct engine_workers.py texts are patched, and the worker's early texts are skipped."""
    repo = clone("verl", tmp_path / "verl")
    shas = _picked(repo, commits(repo))
    assert len(shas) >= 10


RECEIVED_PATH = "verl/workers/rollout/vllm_rollout/utils.py"


def test_received_codemod_over_the_history_of_the_vllm_worker_extension(tmp_path):
    """Every upstream commit of verl/workers/rollout/vllm_rollout/utils.py since the v0.6.0 branch
    point (the verl-vllm-rollout-utils bundle): where the file defines vLLMColocateWorkerExtension
    the codemod applies, compiles, is idempotent and reverts byte-exactly."""
    repo = tmp_path / "utils"
    subprocess.run(
        ["git", "clone", "-q", "--branch", "main", str(DATA / "verl-vllm-rollout-utils.bundle"), str(repo)],
        check=True,
        capture_output=True,
    )
    codemod = VerlWeightsReceived()
    patched, absent, refused = 0, 0, []
    for commit in commits(repo):
        text = git(repo, "show", f"{commit.sha}:{RECEIVED_PATH}")
        if not codemod.present(text):
            absent += 1
            continue
        try:
            result = codemod.apply(text)
        except UserError as exc:
            refused.append((commit.date, commit.subject, str(exc)[:120]))
            continue
        assert codemod.apply(result) == result and codemod.revert(result) == text, commit
        assert codemod.status(result).status is Status.APPLIED
        compile(result, RECEIVED_PATH, "exec")
        patched += 1
    assert not refused, refused
    assert patched >= 30, (patched, absent)

"""verl-weights-sent over the real upstream history of verl/workers/engine_workers.py (the verl
bundle of tests/data/history): every commit whose change touches a line with
`get_per_tensor_param` or a top-level class, plus the newest ones. Where the file defines
ActorRolloutRefWorker the codemod must apply (every anchor found), compile, be idempotent and
revert byte-exactly; where the worker does not exist yet it is not the codemod's subject.

The received side (verl/workers/rollout/vllm_rollout/utils.py, not in the verl bundle) walks its
own small bundle, tests/data/history/verl-vllm-rollout-utils.bundle (see the README there); the
bucket side (verl-weights-bucket) walks verl-bucketed-weight-transfer.bundle, every commit of the
file since it was created, and refuses where a shape has no site (BUCKET_REFUSED).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rl_msprobe.codemods.base import AnchorError, Status, top_level_classes
from rl_msprobe.codemods.verl_weights import (
    RECEIVER,
    SENDER,
    VerlWeightsBucket,
    VerlWeightsReceived,
    VerlWeightsSent,
)
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


def _small_bundle(name: str, tmp_path) -> Path:
    """A clone of tests/data/history/NAME.bundle (one file's history, see the README there)."""
    repo = tmp_path / name
    subprocess.run(
        ["git", "clone", "-q", "--branch", "main", str(DATA / f"{name}.bundle"), str(repo)],
        check=True,
        capture_output=True,
    )
    return repo


def test_received_codemod_over_the_history_of_the_vllm_worker_extension(tmp_path):
    """Every upstream commit of verl/workers/rollout/vllm_rollout/utils.py since the v0.6.0 branch
    point (the verl-vllm-rollout-utils bundle): where the file defines vLLMColocateWorkerExtension
    the codemod applies, compiles, is idempotent and reverts byte-exactly."""
    repo = _small_bundle("verl-vllm-rollout-utils", tmp_path)
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


BUCKET_PATH = "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
# upstream commits whose shape has no site for a capability: the anchor the refusal must name
BUCKET_REFUSED = {
    # a generator BucketedWeightReceiver.iter_weights read buckets in its own loop (vLLM's
    # reload_weights consumed it, bypassing receive_weights' callback); reverted by 393b03a
    "a32d63538a765577f73b7f420c28cb0fe89f650e": "bucket receive loops",
}
# `META[NAME] = {` opening a line: a tensor's bucket metadata, counted without the codemod
ENTRY_LINE = re.compile(r"^\s+\w+\[\w+\] = \{\s*$", re.MULTILINE)
# one drift per anchor: (anchor, pattern, replacement) applied to a real upstream text
BUCKET_DRIFTS = (
    (f"class {SENDER}", rf"^class {SENDER}\b", "class BucketedWeightPusher"),
    ("bucket metadata entry", r"^(\s+\w+)\[(\w+)\] = \{", r"\1[str(\2)] = {"),
    (f"class {RECEIVER}", rf"^class {RECEIVER}\b", "class BucketedWeightPuller"),
    (
        "bucket metadata arrival",
        r"(\s)metadata = self\.socket\.recv_pyobj\(\)",
        r"\1metadata = self.socket.recv()",
    ),
    ("bucket callback", r"^(\s+)on_bucket_received\(", r"\1self.loaded = on_bucket_received("),
)


def _bucket_history(tmp_path) -> list[tuple[str, str]]:
    """(upstream hash, the file's text) for every commit of the bundle, oldest first."""
    repo = _small_bundle("verl-bucketed-weight-transfer", tmp_path)
    found = []
    for commit in commits(repo):
        upstream = re.search(
            r"^upstream: ([0-9a-f]{40})$", git(repo, "log", "-1", "--format=%B", commit.sha), re.M
        )
        assert upstream, commit
        found.append((upstream[1], git(repo, "show", f"{commit.sha}:{BUCKET_PATH}")))
    return found


def test_bucket_codemod_over_the_history_of_the_bucketed_weight_transfer(tmp_path):
    """Every upstream commit of main that changed bucketed_weight_transfer.py, from the one that
    created it: where the file defines both classes the codemod applies (a tag after every tensor
    entry of the sender, counted here without it), compiles, is idempotent and reverts byte-exactly,
    or refuses naming the anchor where BUCKET_REFUSED says the shape has no site."""
    history = _bucket_history(tmp_path)
    codemod = VerlWeightsBucket()
    applied, refused = [], {}
    for upstream, text in history:
        assert {SENDER, RECEIVER} <= set(top_level_classes(text)), upstream
        try:
            result = codemod.apply(text)
        except AnchorError as exc:
            assert codemod.status(text).status is Status.CONFLICT
            refused[upstream] = exc.anchor
            continue
        assert codemod.apply(result) == result and codemod.revert(result) == text, upstream
        assert codemod.status(result).status is Status.APPLIED
        compile(result, BUCKET_PATH, "exec")
        sender = text.split(f"\nclass {RECEIVER}")[0]
        assert result.count("rl_msprobe_weights.tag(") == len(ENTRY_LINE.findall(sender)) >= 1, upstream
        assert (
            result.count("rl_msprobe_weights.arrived(") == result.count("rl_msprobe_weights.settled()") == 1
        )
        applied.append(upstream)
    assert refused == BUCKET_REFUSED
    assert history[0][0].startswith("c0388b4dc") and len(applied) == len(history) - len(refused) >= 8


def test_bucket_codemod_refuses_each_missing_site_in_every_upstream_shape(tmp_path):
    """In every applied upstream text, one anchor's site drifted at a time (a class renamed, the
    entry's key not a plain name, the metadata read another way, the callback's result kept): the
    codemod raises naming that anchor and the file, rather than apply the rest of it."""
    checked = 0
    codemod = VerlWeightsBucket()
    for upstream, text in _bucket_history(tmp_path):
        if upstream in BUCKET_REFUSED:
            continue
        for anchor, pattern, replacement in BUCKET_DRIFTS:
            drifted, n = re.subn(pattern, replacement, text, flags=re.MULTILINE)
            assert n >= 1, (upstream, anchor)
            with pytest.raises(AnchorError) as info:
                codemod.apply(drifted)
            assert info.value.anchor == anchor, (upstream, anchor, info.value.anchor)
            assert BUCKET_PATH in str(info.value) and f"'{anchor}'" in str(info.value)
            checked += 1
    assert checked == 5 * 8, checked

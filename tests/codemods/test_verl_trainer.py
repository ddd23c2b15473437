"""Before/after fixtures and properties of the verl trainer and request-id codemods.

Fixtures (`fixtures/codemods/<codemod>/`, run by tests/codemods/test_every_codemod.py) are small
files in the shape of upstream code, one per drift variant, named `<codemod prefix>_<variant>`.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from rl_msprobe.codemods.base import AnchorError, Status
from rl_msprobe.codemods.verl_request_id import (
    VerlAgentLoopRequestId,
    VerlAgentLoopTQRequestId,
    VerlFullyAsyncRolloutRequestId,
    VerlLLMServerRequestId,
)
from rl_msprobe.codemods.verl_trainer import (
    VerlFullyAsyncTrainer,
    VerlRayTrainer,
    VerlSeparateTrainer,
    VerlSyncTrainer,
    VerlV1Trainer,
)
from tests.support.codemod_cases import FIXTURES, invalid, pairs

CODEMODS = {
    "ray_fit": VerlRayTrainer(),
    "separate": VerlSeparateTrainer(),
    "v1_base": VerlV1Trainer(),
    "sync": VerlSyncTrainer(),
    "fully_async": VerlFullyAsyncTrainer(),
    "agent_loop": VerlAgentLoopRequestId(),
    "llm_server": VerlLLMServerRequestId(),
    "fully_async_rollouter": VerlFullyAsyncRolloutRequestId(),
    "agent_loop_tq": VerlAgentLoopTQRequestId(),
}


def codemod_for(path):
    stem = path.name.split(".")[0]
    prefix = stem.rsplit("_v", 1)[0] if "_v0" in stem else stem.rsplit("_", 1)[0]
    return CODEMODS[prefix]


PAIRS = [pair for codemod in CODEMODS.values() for pair in pairs(codemod.fixture_folder)]
INVALID = [path for codemod in CODEMODS.values() for path in invalid(codemod.fixture_folder)]


def test_every_codemod_has_a_fixture_and_a_drift_case():
    used = {codemod_for(b).name for b, _ in PAIRS}
    assert used == {c.name for c in CODEMODS.values()}
    assert {codemod_for(p).name for p in INVALID} >= {
        "verl-ray-trainer",
        "verl-separate-trainer",
        "verl-fully-async-trainer",
        "verl-agent-loop-request-id",
        "verl-llm-server-request-id",
        "verl-agent-loop-tq-request-id",
    }


def _read(name):
    return (FIXTURES / codemod_for(Path(name)).fixture_folder / name).read_text()


def test_trim_scoped_to_the_recompute_method():
    """The second bypass line (advantage step) and other compute_log_prob calls stay untouched."""
    for name, method, other in (
        ("separate_v071.before.py", "_fit_compute_log_prob", "_fit_compute_advantage"),
        ("v1_base_v090.before.py", "_compute_old_log_prob", "_compute_advantage"),
        ("ray_fit_v060.before.py", "fit", "_validate"),
        ("ray_fit_v091.before.py", "fit", "_compute_old_log_prob"),
    ):
        out = codemod_for(Path(name)).apply(_read(name))
        assert out.count("prompts_forward(self, batch)") == 1, name
        body = out.split(f"def {method}(")[1].split("\n    def ")[0]
        other_body = out.split(f"def {other}(")[1].split("\n    def ")[0]
        assert "prompts_forward" in body and "prompts_forward" not in other_body, name


def test_ray_trainer_060_trims_right_before_the_recompute():
    out = VerlRayTrainer().apply(_read("ray_fit_v060.before.py"))
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "prompts_forward" in line)
    assert lines[at + 1].strip() == "old_log_prob = self.actor_rollout_wg.compute_log_prob(batch)"
    assert lines[at - 1].strip().startswith('with marked_timer("old_log_prob"')


def test_fully_async_trims_after_the_queue_block():
    out = VerlFullyAsyncTrainer().apply(_read("fully_async_v080.before.py"))
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "prompts_forward" in line)
    assert lines[at - 1].strip() == "self._collect_metrics_from_samples(batch, metrics)"
    assert lines[at].startswith("        rl_msprobe_consistency.")  # method level, after the with block


def test_request_id_lines_surround_the_server_call():
    for name in ("agent_loop_v060.before.py", "agent_loop_v071.before.py", "llm_server_v091.before.py"):
        out = codemod_for(Path(name)).apply(_read(name))
        tree = cst.parse_module(out)
        assert tree.code == out
        lines = out.splitlines()
        record = next(i for i, line in enumerate(lines) if "record_request_id(server)" in line)
        assert "await server.generate.remote(" in lines[record + 1]
        keep = next(i for i, line in enumerate(lines) if "keep_request_id(output, server)" in line)
        assert lines[keep - 1].strip() == ")" and keep > record
        indent = len(lines[record]) - len(lines[record].lstrip())
        assert len(lines[keep]) - len(lines[keep].lstrip()) == indent  # same block


def test_llm_server_code_decides_whether_the_fully_async_client_is_patched():
    """Shape, not version: the same 0.8.0 file gets the same lines whatever version is claimed; a
    fully-async subclass of LLMServerClient is patched under any name (FullyLLMServerClient was main's
    name in spring 2026), and one whose resume call moved is a missing anchor."""
    codemod = VerlLLMServerRequestId()
    source = _read("llm_server_v080.before.py")
    for version in ("0.8.0", None, "0.9.1", "0.10.0.dev"):
        assert codemod.apply(source, version=version).count("rl-msprobe:") == 3
    v091 = _read("llm_server_v091.before.py")
    assert "class FullyAsyncLLMServerClient(LLMServerClient)" in v091
    renamed = v091.replace("FullyAsyncLLMServerClient", "FullyLLMServerClient")
    out = codemod.apply(renamed, version="0.8.0.dev")
    assert out.count("keep_parent_extra_fields(final_output, output)") == 1
    assert out.count("rl-msprobe:") == codemod.apply(v091).count("rl-msprobe:")
    moved = renamed.replace("await super().generate(", "await self._generate_once(")
    with pytest.raises(AnchorError) as info:
        codemod.apply(moved, version="0.8.0.dev")
    assert "super().generate call" in str(info.value) and "0.8.0.dev" in str(info.value)


def test_anchor_changed_after_apply_is_a_conflict():
    codemod = VerlSeparateTrainer()
    applied = codemod.apply(_read("separate_v071.before.py"))
    drifted = applied.replace(
        'bypass_recomputing_logprobs = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)\n        if',
        "use_rollout = rollout_corr_config is not None\n        if",
        1,
    )
    assert drifted != applied
    report = codemod.status(drifted)
    assert report.status is Status.CONFLICT and "bypass_recomputing_logprobs line" in report.detail


def test_request_id_call_moved_after_apply_is_a_conflict():
    codemod = VerlLLMServerRequestId()
    applied = codemod.apply(_read("llm_server_v080.before.py"))
    drifted = applied.replace("await server.generate.remote(", "await server.generate_tokens.remote(")
    report = codemod.status(drifted)
    assert report.status is Status.CONFLICT and "server.generate.remote call" in report.detail

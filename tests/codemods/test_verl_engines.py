"""What the verl engine codemods insert where (the fixture properties of every codemod run in
tests/codemods/test_every_codemod.py)."""

from __future__ import annotations

from rl_msprobe.codemods.base import Status
from rl_msprobe.codemods.verl_fsdp_engine import VerlFSDPEngine
from rl_msprobe.codemods.verl_megatron_engine import VerlMegatronEngine
from tests.support.codemod_cases import pairs


def test_megatron_value_head_is_left_alone():
    codemod = VerlMegatronEngine()
    ((before, _),) = [p for p in pairs("verl-megatron-engine") if "fused" in p[0].name]
    out = codemod.apply(before.read_text())
    value_head = out.split("class MegatronEngineWithValueHead")[1]
    assert "rl-msprobe" not in value_head
    assert out.count("megatron_forward_start") == 2 and out.count("megatron_forward_end") == 2


def test_fsdp_wraps_the_with_block_not_the_loop_head():
    codemod = VerlFSDPEngine()
    ((before, _),) = [p for p in pairs("verl-fsdp-engine") if "v091" in p[0].name]
    lines = codemod.apply(before.read_text()).splitlines()
    start = next(i for i, line in enumerate(lines) if "micro_batch_start" in line)
    assert lines[start - 1].strip().startswith("# Name each micro-batch"), (
        "comments stay above the inserted line"
    )
    assert lines[start + 1].strip().startswith("with ctx, sync_ctx")
    end = next(i for i, line in enumerate(lines) if "micro_batch_end" in line)
    assert lines[end + 2].strip() == "output_lst.append(meta_info)"


def test_moved_anchor_after_apply_is_a_conflict():
    codemod = VerlFSDPEngine()
    ((before, _),) = [p for p in pairs("verl-fsdp-engine") if "v060" in p[0].name]
    applied = codemod.apply(before.read_text())
    drifted = applied.replace("for micro_batch in micro_batches:", "for micro_batch in chunks:")
    report = codemod.status(drifted)
    assert report.status is Status.CONFLICT and "micro-batch loop" in report.detail

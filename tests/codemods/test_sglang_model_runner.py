"""Before/after fixtures and properties of the SGLang codemods (model_runner.py, io_struct.py)."""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import AnchorError
from rl_msprobe.codemods.sglang_io_struct import SGLangIoStruct
from rl_msprobe.codemods.sglang_model_runner import SGLangModelRunner
from tests.support.codemod_cases import (
    FIXTURES,
    invalid,
    pairs,
)


def test_every_drift_variant_has_a_fixture():
    names = {b.name.split(".")[0] for b, _ in pairs("sglang-model-runner")}
    assert names == {"parse_args_v046", "moe_ep_v0410", "dp_rank_v051", "recorder_outputs_v0510"}
    assert {p.name.split(".")[0] for p in invalid("sglang-model-runner")} == {"counter_moved", "two_returns"}


@pytest.mark.parametrize("variant", ["parse_args_v046", "recorder_outputs_v0510"])
def test_where_the_lines_go(variant):
    """create right after the counter's initialisation; start right after the counter step in
    forward; finish right before `return output` (after every other statement)."""
    lines = SGLangModelRunner().apply((FIXTURES / "sglang-model-runner" / f"{variant}.before.py").read_text())
    lines = [line.strip() for line in lines.splitlines()]
    marker = "  # rl-msprobe:sglang-model-runner"
    create = lines.index(f"rl_msprobe_dump.create(self){marker}")
    assert lines[create - 1] == "self.forward_pass_id = 0"
    start = lines.index(f"rl_msprobe_dump.start(self){marker}")
    assert lines[start - 1] == "self.forward_pass_id += 1"
    finish = lines.index(f"rl_msprobe_dump.finish(self){marker}")
    assert lines[finish + 1] == "return output"
    assert create < start < finish


def test_subclass_forward_is_left_alone():
    """Only ModelRunner is patched: a subclass with its own counter and `return output` is not."""
    after = SGLangModelRunner().apply(
        (FIXTURES / "sglang-model-runner" / "moe_ep_v0410.before.py").read_text()
    )
    draft = after[after.index("class DraftModelRunner") :]
    assert "rl_msprobe_dump" not in draft


def test_missing_anchor_names_file_anchor_and_version():
    source = (FIXTURES / "sglang-model-runner" / "counter_moved.invalid.py").read_text()
    with pytest.raises(AnchorError) as info:
        SGLangModelRunner().apply(source, version="0.5.13")
    assert info.value.anchor == "forward: self.forward_pass_id += 1"
    assert "sglang/srt/model_executor/model_runner.py" in str(info.value) and "0.5.13" in str(info.value)


def test_bootstrap_room_line_is_first_after_the_docstring():
    after = SGLangIoStruct().apply((FIXTURES / "sglang-io-struct" / "normalize_v052.before.py").read_text())
    lines = [line.strip() for line in after.splitlines()]
    at = lines.index("rl_msprobe_bootstrap_room.pin(self)  # rl-msprobe:sglang-io-struct")
    assert lines[at - 1] == '"""Normalize bootstrap parameters for batch processing."""'
    assert after.count("rl_msprobe_bootstrap_room.pin(self)") == 1  # not in EmbeddingReqInput

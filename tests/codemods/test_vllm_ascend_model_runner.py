"""Before/after fixtures and properties of the vLLM-Ascend model-runner codemod."""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import AnchorError
from rl_msprobe.codemods.vllm_ascend_model_runner import VllmAscendModelRunner
from tests.support.codemod_cases import FIXTURES

CODEMOD = VllmAscendModelRunner()
FOLDER = CODEMOD.fixture_folder
LOG = "dispatch_logger.log_step(self, scheduler_output)"
ATTACH = "dispatch_logger.attach(self)"


# DOMAIN §5: the dump finish points of each generation, per method, and the debugger creations.
@pytest.mark.parametrize(
    ("variant", "execute_model", "sample_tokens", "attaches"),
    [
        ("need_dump_v012", 2, 2, 1),
        ("debugger_not_none_v013", 2, 2, 1),
        ("three_stops_v015", 2, 1, 1),
        ("finalize_v020", 3, 1, 2),
    ],
)
def test_every_finish_point_gets_a_log_line(variant, execute_model, sample_tokens, attaches):
    after = (FIXTURES / FOLDER / f"{variant}.after.py").read_text()
    lines = [line.strip() for line in after.splitlines()]
    logs = [i for i, line in enumerate(lines) if line.startswith(LOG)]
    for i in logs:  # each log line sits right before the statement that finishes the dump
        assert lines[i + 1] in ("self.debugger.stop()", "self._finalize_dump_data()")
    sample_at = lines.index(next(line for line in lines if line.startswith("def sample_tokens")))
    assert sum(i < sample_at for i in logs) == execute_model
    assert sum(i > sample_at for i in logs) == sample_tokens
    creations = [i for i, line in enumerate(lines) if line.startswith(ATTACH)]
    assert len(creations) == attaches
    assert all(lines[i - 1].startswith("self.debugger = ") for i in creations)


def test_dummy_run_and_the_finalize_method_are_left_alone():
    after = (FIXTURES / FOLDER / "finalize_v020.after.py").read_text()
    tail = after[after.index("def _dummy_run") :]
    assert LOG not in tail  # dump=False discards a dummy step; _finalize_dump_data's own stop() is not a site


def test_missing_scheduler_output_is_named():
    source = (FIXTURES / FOLDER / "sample_tokens_without_scheduler_output.invalid.py").read_text()
    with pytest.raises(AnchorError) as info:
        CODEMOD.apply(source, version="0.31.0")
    assert info.value.anchor == "sample_tokens: scheduler_output"


def test_no_msprobe_support_is_named():
    with pytest.raises(AnchorError) as info:
        CODEMOD.apply((FIXTURES / FOLDER / "no_msprobe_v011.invalid.py").read_text(), version="0.11.0")
    assert info.value.anchor == "__init__: self.debugger = ..."
    assert "0.12.0rc1" in str(info.value)

"""Version ranges (information: notes, the tested range) and the untested-version warning."""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import version_in_range
from rl_msprobe.patches import get_set


@pytest.mark.parametrize(
    ("version", "low", "high", "inside"),
    [
        ("0.6.0", "0.6.0", "0.9.1", True),
        ("0.9.1", "0.6.0", "0.9.1", True),
        ("0.5.4", "0.6.0", "0.9.1", False),
        ("0.6.0rc1", "0.6.0", "0.9.1", False),
        ("0.9.1.post1", "0.6.0", "0.9.1", True),
        ("0.9.2rc1", "0.6.0", "0.9.1", False),
        ("0.9.2", "0.6.0", "0.9.1", False),
        ("0.30.0rc2", "0.12.0rc1", "0.30.0rc2", True),
        ("0.30.0", "0.12.0rc1", "0.30.0rc2", False),
        ("0.12.0rc1", "0.12.0rc1", None, True),
        (None, "0.6.0", "0.9.1", True),  # unknown version: the anchors decide
        ("not-a-version", "0.6.0", "0.9.1", True),
    ],
)
def test_version_in_range(version, low, high, inside):
    assert version_in_range(version, low, high) is inside


@pytest.mark.parametrize(
    ("name", "version", "tested", "why"),
    [
        ("verl-consistency", "0.9.1", True, ""),
        ("verl-consistency", "0.9.1.post1", True, ""),
        ("verl-consistency", "0.10.0.dev", False, "newer than the newest tested release 0.9.1"),
        ("verl-consistency", "0.9.2rc1", False, "newer than the newest tested release 0.9.1"),
        ("verl-consistency", "0.8.0.dev", False, "development build"),
        ("verl-consistency", "0.9.1+local", False, "development build"),
        ("verl-consistency", "0.6.1", False, "older than the oldest tested release 0.7.0"),
        ("verl-consistency", None, False, "not a tested release"),
        ("vllm-ascend-dispatch-log", "0.30.0rc2", True, ""),
        ("vllm-ascend-dispatch-log", "0.31.0rc1", False, "newer than the newest tested release 0.30.0rc2"),
    ],
)
def test_tested_is_information_with_its_warning(name, version, tested, why):
    patch_set = get_set(name)
    assert patch_set.tested(version) is tested
    warning = patch_set.untested_warning(version)
    assert (warning is None) is tested
    if warning:
        assert why in warning and "review the diff" in warning

"""Version ranges of codemods and sets (inclusive, pre- and post-releases)."""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import version_in_range


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

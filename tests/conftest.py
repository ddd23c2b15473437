"""Test-session settings shared by every area."""

from __future__ import annotations

import os

from hypothesis import settings

# the cached test venvs start building in the background right after collection, and the tests
# that need none of them run first
from tests.support.prebuild import pytest_collection_finish, pytest_collection_modifyitems  # noqa: F401

# the CI skip gate: a skip for any reason but a missing accelerator fails the run under CI
from tests.support.skip_gate import (  # noqa: F401  (pytest finds the hooks here)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# the two tiers: `python -m pytest` (default) and `python -m pytest --full` (tests/support/tiers.py)
pytest_plugins = ["tests.support.tiers"]

# CI runs the same generated examples every time (a fixed seed), so a property failure there is
# reproducible; locally hypothesis explores new examples on each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

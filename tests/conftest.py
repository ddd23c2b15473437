"""Test-session settings shared by every area."""

from __future__ import annotations

import os

from hypothesis import settings

# CI runs the same generated examples every time (a fixed seed), so a property failure there is
# reproducible; locally hypothesis explores new examples on each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

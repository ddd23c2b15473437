"""The newest verl release rl-msprobe knows, in one place.

Two readers must agree on it: the planner assumes it when a script's verl version is unknown
(`modes.base.NEWEST`), and every verl patch set is tested up to it and uses it as the default
release of `patch diff` (`patches.verl.NEWEST`). A leaf module, so the planner reads it without
importing the patch sets (and LibCST).
"""

from __future__ import annotations

VERL_NEWEST = "0.9.1"

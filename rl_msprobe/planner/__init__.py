"""The launch-script planner: detect, check and plan a derived script and its msprobe configs.

- `core`: PlanRequest -> plan -> Plan, check -> CheckReport, detect_text (pure, in memory)
- `prepare`: one `prepare` run: msprobe probe, plan, the files it writes, the command line
- `msprobe_config`: msprobe's config.json, built and validated
- `env`: msprobe in the training interpreter (probe, install)
- `outputs`: the derived files, written all or nothing
- `modes`: the rules of each collection mode (training, inference, consistency, triage, weights)
Reading the launch script is `rl_msprobe.launch`'s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it; loaded on first use, so the modes can read
# `planner.msprobe_config` without importing the planner core (which imports the modes)
_PUBLIC = {
    "CheckReport": "core",
    "Plan": "core",
    "PlanRequest": "core",
    "check": "core",
    "detect_text": "core",
    "patch_commands": "core",
    "plan": "core",
    "read": "core",
    "requirements": "core",
    "build_context": "core",
}

if TYPE_CHECKING:
    from rl_msprobe.planner.core import (
        CheckReport,
        Plan,
        PlanRequest,
        build_context,
        check,
        detect_text,
        patch_commands,
        plan,
        read,
        requirements,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_msprobe.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_msprobe.planner.{module}"), name)


__all__ = [
    "CheckReport",
    "Plan",
    "PlanRequest",
    "build_context",
    "check",
    "detect_text",
    "patch_commands",
    "plan",
    "read",
    "requirements",
]

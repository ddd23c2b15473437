"""The launch-script planner: detect, check and plan a derived script and its msprobe configs.

- `registry`: the mode table (`Mode`): every mode's hint words, rules module, outputs and sets
- `reading`: the script parsed, its mode detected, its verl config composed (`read`, `detect_text`)
- `mode_choice`: the mode asked or detected and its rules on this job (`requirements`)
- `checking`: check -> CheckReport; `planning`: PlanRequest -> plan -> Plan (pure, in memory;
  the modules are not named `check` / `plan`, which would hide the functions of this package)
- `patch_advice`: the `patch apply` commands a plan prints
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
# `planner.msprobe_config` without importing the planner (which imports the modes)
_PUBLIC = {
    "CheckReport": "checking",
    "Plan": "planning",
    "PlanRequest": "planning",
    "check": "checking",
    "detect_text": "reading",
    "patch_commands": "patch_advice",
    "plan": "planning",
    "read": "reading",
    "requirements": "mode_choice",
    "build_context": "mode_choice",
}

if TYPE_CHECKING:
    from rl_msprobe.planner.checking import CheckReport, check
    from rl_msprobe.planner.mode_choice import build_context, requirements
    from rl_msprobe.planner.patch_advice import patch_commands
    from rl_msprobe.planner.planning import Plan, PlanRequest, plan
    from rl_msprobe.planner.reading import detect_text, read


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

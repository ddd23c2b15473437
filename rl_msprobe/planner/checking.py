"""`check`: a mode's rules evaluated on any script, in memory (`CheckReport`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.launch.detect import Detection
from rl_msprobe.planner.mode_choice import build_context, choose_mode, requirements
from rl_msprobe.planner.modes.base import (
    CheckResult,
    Options,
    check_requirements,
)
from rl_msprobe.planner.patch_advice import entry_point_of, patch_commands
from rl_msprobe.planner.reading import check_keys, compose_violation, detect_text, refuse_crlf


@dataclass
class CheckReport:
    mode: str
    detection: Detection
    result: CheckResult
    notes: list[str]
    entry_point: str | None = None  # `patch apply --for` (None: no entry point rl-msprobe knows)
    patch_commands: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.result.ok,
            "mode": self.mode,
            "violations": [v.to_json() for v in self.result.violations],
            "unverifiable": self.result.unverifiable,
            "warnings": self.result.warnings,
            "detection": self.detection.to_json(),
            "entry_point": self.entry_point,
            "patch_commands": self.patch_commands,
            "notes": self.notes,
        }


def check(
    text: str,
    path: str,
    mode: str | None = None,
    backend: str | None = None,
    hint: str | None = None,
    versions: dict[str, str | None] | None = None,
    train_backend: str | None = None,
    command: int | None = None,
    verl_root: Path | None = None,
    patch_target: dict[str, str] | None = None,
    vllm_root: Path | None = None,
    batch_one: bool = False,
    python: str | None = None,
    model_config: str | None = None,
) -> CheckReport:
    refuse_crlf(text, path)  # bash would not run it as written: exit 2
    script, detection = detect_text(text, path, hint, command, verl_root, (versions or {}).get("verl"))
    keys = check_keys(script, detection)  # a key verl would refuse: exit 2
    chosen = choose_mode(detection, mode, path)
    options = Options(
        backend=backend,
        train_backend=train_backend,
        batch_one=batch_one,
        python=python,
        model_config=model_config,
    )
    if chosen == "consistency":  # the plan prepare wrote into the derived script's header
        from rl_msprobe.planner.consistency_plan import options_from

        options = options_from(text, options)
    # settings that hold paths accept any absolute path: the folders here only name defaults
    ctx = build_context(
        script, detection, versions or {}, options, "/path/to", "/path/to/dump", vllm_root=vllm_root
    )
    req = requirements(ctx, chosen)
    result = check_requirements(ctx, req)
    broken = compose_violation(script, detection) if not req.violations else None
    if broken is not None:
        broken = dataclasses.replace(
            broken,
            fix=broken.fix + " (is it the verl version the script was written for? pass --tree or --python)",
        )
    if broken is not None:
        result.violations.append(broken)
    if keys.unchecked:
        result.unverifiable.insert(0, keys.unchecked)
    entry, entry_notes = entry_point_of(script, req.patch_sets)
    commands = patch_commands(req.patch_sets, patch_target or {}, entry) if not req.violations else []
    return CheckReport(chosen, detection, result, [*script.notes, *req.notes, *entry_notes], entry, commands)

"""`plan`: everything `prepare` writes, in memory: the derived script, its msprobe configs, the
changes it makes with their reasons, and the check of the derived script by the same rules
(a plan whose derived script fails its own check says so). Files are written by
`planner.outputs`, never here."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import __version__
from rl_msprobe.errors import UserError
from rl_msprobe.launch.detect import STAGES, Detection, detect
from rl_msprobe.launch.overrides import format_value, same_value
from rl_msprobe.launch.render import Token, comment, render
from rl_msprobe.mode_table import get_mode
from rl_msprobe.planner import msprobe_config
from rl_msprobe.planner.mode_choice import build_context, choose_mode, mode_requirements
from rl_msprobe.planner.modes.base import (
    CheckResult,
    Context,
    Options,
    Requirements,
    Violation,
    check_requirements,
    env_in_script,
)
from rl_msprobe.planner.patch_advice import entry_point_of, patch_commands
from rl_msprobe.planner.reading import check_keys, compose_violation, detect_text, read, refuse_crlf


@dataclass(frozen=True)
class Change:
    """One value prepare changes in the derived script, with the rule and the reason `check` gives."""

    rule: str
    key: str
    found: str
    required: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {
            "rule": self.rule,
            "key": self.key,
            "found": self.found,
            "required": self.required,
            "why": self.why,
        }

    def line(self) -> str:
        return f"[{self.rule}] {self.key}: {self.found or '-'} -> {self.required or '-'} ({self.why})"


def changes_made(ctx: Context, req: Requirements) -> list[Change]:
    """Every value the derived script writes that the original does not already hold, and every key
    it takes out, each with its rule and the reason `check` gives for it (so the two agree)."""
    changes: list[Change] = []
    for s in req.settings:
        found = ctx.overrides.get(s.key)
        if found is not None and same_value(found.value, s.value):
            continue
        value, origin = ctx.value(s.key)
        before = "set at run time" if origin == "runtime" else _found_text(value, origin)
        changes.append(Change(s.rule, s.key, before, format_value(s.value), s.why))
    for e in req.env:
        exported = env_in_script(ctx, e.name)
        if exported == e.value:
            continue
        changes.append(Change(e.rule, e.name, "not set" if exported is None else exported, e.value, e.why))
    for key, why in req.removals:
        found = ctx.overrides.get(key)
        before = format_value(found.value) if found is not None else "set"
        changes.append(Change("removed", key, before, "not set", why))
    return changes


def _found_text(value: Any, origin: str) -> str:
    return f"not set (verl's default: {format_value(value)})" if origin == "default" else format_value(value)


@dataclass(frozen=True)
class Plan:
    """What `prepare` writes (or why it refuses), with the checks of the derived script."""

    mode: str
    original: str
    derived_path: str
    configs: dict[str, tuple[str, dict[str, Any]]]  # role -> (path, document)
    patch_sets: list[str]
    patch_commands: list[str]
    notes: list[str]
    detection: Detection
    versions: dict[str, str | None]
    violations: list[Violation] = field(default_factory=list)
    derived_text: str = ""
    unverifiable: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refused: bool = False
    diff: str = ""
    env: list[tuple[str, str, str]] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    entry_point: str | None = None  # `patch apply --for` (None: no entry point rl-msprobe knows)
    msprobe: dict[str, str] = field(default_factory=dict)  # level, task, risk_level of every config

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "original": self.original,
            "msprobe": self.msprobe,
            "script": None if self.refused else self.derived_path,
            "configs": {} if self.refused else {role: path for role, (path, _) in self.configs.items()},
            "patch_sets": self.patch_sets,
            "entry_point": self.entry_point,
            "patch_commands": self.patch_commands,
            "violations": [v.to_json() for v in self.violations],
            "unverifiable": self.unverifiable,
            "warnings": self.warnings,
            "changes": [c.to_json() for c in self.changes],
            "notes": self.notes,
            "detection": self.detection.to_json(),
            "versions": self.versions,
            "written": not self.refused,
            "diff": self.diff,
        }


def derived_name(path: str, mode: str) -> str:
    stem = os.path.basename(path)
    stem = re.sub(r"\.(sh|bash)$", "", stem)
    stem = re.sub(r"^run_", "", stem) or "job"
    return f"{get_mode(mode).derived_prefix}{stem}.sh"


def _dump_dir_ok(path: str) -> bool:
    return bool(msprobe_config.DUMP_PATH_RE.match(path))


@dataclass(frozen=True)
class PlanRequest:
    """What `prepare` asks the planner for: the script and every choice the user made.

    `path` must be absolute. `out_dir` / `dump_dir`: the folders as typed (None: the defaults).
    `options`: the choices that shape the mode's rules (the modes read them as `ctx.options`).
    `task`: msprobe's dump task (statistics, or tensor: whole tensors, for cosine and
    element-wise errors). `with_weights`: the weight fingerprints of --mode weights on
    top of the chosen mode (`prepare --weights`). `patch_target`: how a patch command names each
    project's tree. `regenerate`: the command line that wrote the derived script."""

    text: str
    path: str
    mode: str | None = None
    hint: str | None = None
    out_dir: str | None = None
    dump_dir: str | None = None
    options: Options = field(default_factory=Options)
    versions: dict[str, str | None] = field(default_factory=dict)
    patch_target: dict[str, str] = field(default_factory=dict)
    regenerate: str | None = None
    command: int | None = None
    verl_root: Path | None = None
    task: str = "statistics"
    with_weights: bool = False
    vllm_root: Path | None = None  # the vLLM tree that runs: its model runners decide the dump path


@dataclass(frozen=True)
class _Layout:
    """Where a plan puts its files: the derived script, the configs' folder, the dump root."""

    out_dir: str
    derived_path: str
    config_dir: str
    dump_root: str


def _check_choices(request: PlanRequest, chosen: str) -> None:
    """--level, --risk-level and --stages: a UserError naming the values to use."""
    if request.options.level not in msprobe_config.LEVELS:
        raise UserError(f"--level {request.options.level}: use mix (the default), L0 or L1.")
    if request.options.risk_level not in msprobe_config.RISK_LEVELS:
        raise UserError(f"--risk-level {request.options.risk_level}: use FOCUS (the default), ALL or CORE.")
    steps = request.options.steps
    if (
        chosen == "consistency"
        and not request.options.batch_one
        and steps is not None
        and (len(steps) != 1 or steps[0] < 1)
    ):
        raise UserError(
            f"--steps {','.join(map(str, steps))}: in consistency mode --steps N is the number of dumped training "
            "steps (one number, at least 1; with --batch-one it is msprobe's step list)."
        )
    stages = request.options.stages
    if stages:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise UserError(
                f"--stages {','.join(stages)}: unknown stage(s) {', '.join(unknown)}; use {', '.join(STAGES)}."
            )
        if chosen != "training":
            raise UserError("--stages applies to training mode only (the stages of verl's global_profiler).")


def _layout(request: PlanRequest, chosen: str) -> _Layout:
    """The derived script beside the original (or in --out), its msprobe folder and dump root."""
    path = request.path
    out_dir = os.path.abspath(request.out_dir or os.path.dirname(path))
    name = derived_name(path, chosen)
    stem = name[len(get_mode(chosen).derived_prefix) : -len(".sh")]
    config_dir = os.path.join(out_dir, f"msprobe_{stem}")
    dump_root = os.path.abspath(request.dump_dir) if request.dump_dir else os.path.join(config_dir, "dump")
    if not _dump_dir_ok(dump_root):  # training: verl hands save_path/step_N/STAGE to msprobe
        raise UserError(
            f"dump folder {dump_root!r} has characters msprobe refuses in dump_path (allowed: letters, digits, "
            "_ . : / -). Pass --dump-dir with a plain absolute folder."
        )
    return _Layout(out_dir, os.path.join(out_dir, name), config_dir, dump_root)


def _configs(
    request: PlanRequest, chosen: str, req: Requirements, config_dir: str
) -> dict[str, tuple[str, dict[str, Any]]]:
    """role -> (path, msprobe config document) for every config the mode needs."""
    msprobe_steps = None if chosen == "training" else request.options.steps
    if chosen == "consistency" and not request.options.batch_one:
        msprobe_steps = None  # --steps counts dumped training steps here, not msprobe's forwards
    if msprobe_steps is None and chosen == "inference":
        msprobe_steps = [0]
    # consistency: every step. One msprobe step is one dumped forward, and the two sides count
    # differently (the actor: one per training step's prompt; the rollout: every prefill and
    # decode forward), so no single list selects the same training steps on both sides.
    configs: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in req.configs:
        doc = msprobe_config.build_config(
            spec.role,
            spec.dump_path,
            level=request.options.level,
            steps=msprobe_steps,
            ranks=request.options.ranks,
            task=request.task,
            risk_level=request.options.risk_level,
        )
        if spec.task_fields and isinstance(doc.get(request.task), dict):
            doc[request.task].update(dict(spec.task_fields))
        configs[spec.role] = (os.path.join(config_dir, spec.filename), doc)
    return configs


def _header(
    request: PlanRequest, chosen: str, env: list[tuple[str, str, str]], decided: list[str]
) -> list[str]:
    """The comment lines at the top of the derived script."""
    path = request.path
    header = [
        comment(
            f"Derived by rl-msprobe {__version__} from {path} for {chosen} collection; the original is unchanged."
        ),
        comment(f"Regenerate with: {_regenerate(request.regenerate, path, chosen)}"),
    ]
    if chosen == "consistency":
        from rl_msprobe.planner.consistency_plan import plan_line

        header.append(plan_line(request.options, decided))
    if env:
        header.append(
            comment(
                "Exported here for this shell and a Ray cluster this script starts; the same values reach the Ray "
                "workers through ++ray_kwargs.ray_init.runtime_env.env_vars.* on the verl command."
            )
        )
    return header


def _derive(
    request: PlanRequest, chosen: str, ctx: Context, req: Requirements
) -> tuple[str, list[tuple[str, str, str]]]:
    """The derived script's text and the environment it exports."""
    env = [(e.name, e.value, e.why) for e in req.env]
    tokens = [Token(s.key, s.value, s.prefix) for s in req.settings]
    # every environment variable also goes to the Ray workers through ray.init's runtime_env
    # (verl merges ray_kwargs.ray_init.runtime_env into ray.init); values must be strings
    tokens += [Token(e.ray_key, e.value, "++") for e in req.env if e.workers]
    header = _header(request, chosen, env, req.decided)
    derived = render(
        ctx.script, ctx.overrides, tokens, env, header, removals=[key for key, _ in req.removals]
    )
    return derived, env


def _check_derived(
    request: PlanRequest,
    chosen: str,
    ctx: Context,
    derived: str,
    derived_path: str,
    configs: dict[str, tuple[str, dict[str, Any]]],
) -> CheckResult:
    """The derived script against the mode's own rules, and the configs (not on disk yet)."""
    detection = ctx.detection
    derived_script = read(derived, derived_path, request.command)
    dctx = build_context(
        derived_script,
        detect(derived_script, request.hint, None, detection.config_values, detection.config_source),
        ctx.versions,
        ctx.options,
        ctx.config_dir,
        ctx.dump_dir,
        ctx.dump_dir_given,
        ctx.vllm_root,
    )
    dctx.__dict__["vllm_runners"] = ctx.vllm_runners  # read once per plan (it runs the codemods)
    dctx.detection.mode = chosen
    dreq = mode_requirements(dctx, chosen, request.with_weights)
    result = check_requirements(dctx, dreq)
    for spec in dreq.configs:
        if spec.role in configs:
            for problem in msprobe_config.validate(configs[spec.role][1], spec.role):
                if problem.severity == "error":
                    result.violations.append(
                        Violation(f"msprobe_config.{spec.role}", problem.key, "", "", problem.message)
                    )
    broken = compose_violation(derived_script, detection, ctx.script)
    if broken is not None:
        result.violations.append(broken)
    return result


def plan(request: PlanRequest) -> Plan:
    """Everything `prepare` writes, in memory: the derived script, its configs, the checks of both."""
    path, versions = request.path, dict(request.versions)
    refuse_crlf(request.text, path)  # bash would not run it as written: exit 2, nothing written
    script, detection = detect_text(
        request.text, path, request.hint, request.command, request.verl_root, versions.get("verl")
    )
    keys = check_keys(script, detection)  # a key verl would refuse: exit 2 before anything else
    unchecked = [keys.unchecked] if keys.unchecked else []
    chosen = choose_mode(detection, request.mode, path)
    _check_choices(request, chosen)
    layout = _layout(request, chosen)
    ctx = build_context(
        script,
        detection,
        versions,
        request.options,
        layout.config_dir,
        layout.dump_root,
        dump_dir_given=bool(request.dump_dir),
        vllm_root=request.vllm_root,
    )
    req = mode_requirements(ctx, chosen, request.with_weights)
    if os.path.abspath(layout.derived_path) == os.path.abspath(path):
        raise UserError(
            f"{path}: the derived script would overwrite the original. Pass --out with another folder."
        )
    configs = _configs(request, chosen, req, layout.config_dir)
    entry, entry_notes = entry_point_of(script, req.patch_sets)
    notes = [*script.notes, *req.notes, *entry_notes]
    if script.command is not None and script.command.extra_args:
        notes.append(
            'The settings come after "$@" in the derived script: arguments given at run time cannot undo them.'
        )
    common: dict[str, Any] = dict(
        mode=chosen,
        original=path,
        derived_path=layout.derived_path,
        configs=configs,
        patch_sets=list(req.patch_sets),
        patch_commands=patch_commands(req.patch_sets, request.patch_target, entry),
        entry_point=entry,
        notes=notes,
        detection=detection,
        versions=versions,
        msprobe={
            "level": request.options.level,
            "task": request.task,
            "risk_level": request.options.risk_level,
        },
    )
    if req.violations:
        return Plan(**common, violations=list(req.violations), unverifiable=unchecked, refused=True)
    changes = changes_made(ctx, req)  # before render: it reads the original's overrides
    derived, env = _derive(request, chosen, ctx, req)
    diff = "".join(
        difflib.unified_diff(
            request.text.splitlines(keepends=True),
            derived.splitlines(keepends=True),
            path,
            layout.derived_path,
        )
    )
    result = _check_derived(request, chosen, ctx, derived, layout.derived_path, configs)
    return Plan(
        **common,
        derived_text=derived,
        violations=result.violations,
        unverifiable=[*unchecked, *(u for u in result.unverifiable if "does not exist (yet)" not in u)],
        warnings=result.warnings,
        diff=diff,
        env=env,
        changes=changes,
    )


def _regenerate(command: str | None, path: str, mode: str) -> str:
    command = command or f"rl-msprobe prepare {shlex.quote(path)}"
    return command if re.search(r"\s--mode[\s=]", command + " ") else f"{command} --mode {mode}"

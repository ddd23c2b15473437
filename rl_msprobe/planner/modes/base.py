"""What every collection mode is made of, and the generic check that runs its rules.

A mode turns a `Context` (the parsed script, its overrides, the detection, the upstream
versions and the user's options) into `Requirements`: the Hydra settings and environment
variables it needs (each with the rule it comes from), the msprobe configs it writes, the
patch sets it needs, and violations that no override can fix (a verl too old). `prepare`
writes the settings into a derived script; `check` evaluates the very same requirements on
any script, so a prepared script always passes its own check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from packaging.version import VERSION_PATTERN, Version

from rl_msprobe.launch.detect import Detection, env_value
from rl_msprobe.launch.overrides import Overrides, format_value, render_override, same_value
from rl_msprobe.launch.script import LaunchScript

if TYPE_CHECKING:
    from rl_msprobe.patches.vllm import RunnerShape

RAY_ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars."
MISSING = object()  # stands for a value the script sets only at run time (not known here)
_VERSION_RE = re.compile(VERSION_PATTERN, re.VERBOSE | re.IGNORECASE)

# verl's defaults (0.8.0 - 0.9.1, verified against the real configs in the tests) for the keys
# the rules look at: what a key is when the script does not set it.
DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.data_parallel_size": 1,
    "actor_rollout_ref.rollout.expert_parallel_size": 1,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": 1,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.context_parallel_size": 1,
    "actor_rollout_ref.actor.profiler.enable": False,
    "actor_rollout_ref.ref.profiler.enable": False,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    "trainer.val_before_train": True,
    "trainer.balance_batch": True,
    "data.train_batch_size": 1024,
    "global_profiler.tool": None,
    "global_profiler.steps": None,
    "global_profiler.save_path": "outputs/profile",
    "rollout.n_gpus_per_node": 8,
    "rollout.nnodes": 1,
    "async_training.require_batches": 1,
    "algorithm.rollout_correction.bypass_mode": False,
    "trainer.total_training_steps": None,
    "trainer.test_freq": -1,
    "trainer.save_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.resume_from_path": None,
    "actor_rollout_ref.rollout.enable_prefix_caching": True,
}
# where the fully-async config (fully_async_ppo_trainer) differs
FULLY_ASYNC_DEFAULTS: dict[str, Any] = {"algorithm.rollout_correction.bypass_mode": True}
# keys whose default is another key's value (verl interpolates them)
FOLLOWS: dict[str, str] = {
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
}


@dataclass(frozen=True)
class Setting:
    """A Hydra key the mode needs, the value prepare writes, and what check accepts."""

    rule: str
    key: str
    value: Any
    prefix: str  # '' for keys in verl's config, '++' for keys that may be absent
    why: str
    accept: Callable[[Any], bool] | None = None
    required: str | None = None  # how the requirement reads in a violation

    def accepts(self, found: Any) -> bool:
        return self.accept(found) if self.accept is not None else same_value(found, self.value)

    @property
    def required_text(self) -> str:
        return self.required or format_value(self.value)

    @property
    def token(self) -> str:
        return render_override(self.key, self.value, self.prefix)


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the job needs; `workers`: Ray workers read it, not only the driver."""

    rule: str
    name: str
    value: str
    why: str
    workers: bool = True
    required: bool = True  # False: recommended only (a warning when missing)
    accept: Callable[[str], bool] | None = None

    @property
    def ray_key(self) -> str:
        return RAY_ENV_PREFIX + self.name

    def accepts(self, found: str | None) -> bool:
        if found is None:
            return False
        return self.accept(found) if self.accept is not None else found == self.value


@dataclass(frozen=True)
class Violation:
    rule: str
    key: str
    found: str
    required: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ConfigSpec:
    role: str  # training | generate | actor | prefill | decode
    filename: str
    dump_path: str | None
    setting_key: str | None  # the override or env var that points at it
    env_name: str | None = None
    task_fields: tuple[
        tuple[str, Any], ...
    ] = ()  # set in the config's task section (the zoom: request_id, list)


@dataclass(frozen=True)
class Options:
    """The user's choices that shape a mode's rules (prepare's and check's options)."""

    level: str = "mix"
    risk_level: str = "ALL"  # msprobe's API-row filter at L1 / mix (msprobe_config.RISK_LEVELS)
    steps: list[int] | None = None
    ranks: list[int] | None = None
    stages: list[str] | None = None
    backend: str | None = None  # rollout engine forced by the user
    pd: bool | None = None
    train_backend: str | None = None  # training backend forced by the user
    python: str | None = None  # prepare --python: the interpreter that runs verl
    prefill_only: bool = False  # consistency: no per-token record of the response (DUMP_POSITIONS)
    max_dump_gib: float | None = None  # consistency: the most one training step may dump (estimate)
    model_config: str | None = None  # --model-config: the model's config.json (or its folder)
    # consistency at the job's own scale (docs/consistency.md); batch_one: the original skill's plan
    batch_one: bool = False
    requests: int | None = None  # requests recorded per dumped step (None: the default, 16, fitted)
    request_ids: tuple[str, ...] = ()  # exactly these request ids (base ids)
    layers: tuple[int, ...] | None = None  # only these decoder layers' modules
    modules: str | None = None  # only modules whose name this regex finds
    from_checkpoint: bool = False  # keep the script's resume settings (trainer.resume_mode)
    prefill_compare: bool = False  # also msprobe's prefill compare (PROMPTS_ONLY), every request
    top_k: int = 20  # triage: the rollout's top-k per response position (0: the sampled token only)
    zoom: Any = None  # consistency: a modes.zoom.ZoomTarget (prepare --zoom ...)


@dataclass
class Context:
    script: LaunchScript
    overrides: Overrides
    detection: Detection
    versions: dict[str, str | None]
    options: Options
    config_dir: str  # absolute folder where the msprobe configs live (prepare) or are expected
    dump_dir: str  # absolute dump root
    dump_dir_given: bool = False  # --dump-dir: the user's folder wins over a save_path the script sets
    vllm_root: Path | None = None  # the vLLM tree that runs (--tree / --python), when known

    @functools.cached_property
    def vllm_runners(self) -> RunnerShape | None:
        """The model runners of the vLLM tree that vllm-dump can patch (None: no tree given)."""
        if self.vllm_root is None:
            return None
        from rl_msprobe.patches.vllm import runner_shape  # the codemods (LibCST): only when asked

        return runner_shape(self.vllm_root, self.versions.get("vllm"))

    @property
    def rollout(self) -> str:
        return self.options.backend or self.detection.rollout

    @property
    def backend(self) -> str:
        return self.options.train_backend or self.detection.train_backend

    def version(self, project: str) -> Version | None:
        text = self.versions.get(project) or ""
        return Version(text) if _VERSION_RE.fullmatch(text.strip()) else None

    def value(self, key: str) -> tuple[Any, str]:
        """(value, where it comes from): the script's override, or verl's default."""
        found = self.overrides.get(key)
        if found is not None:
            return found.value, "script"
        if self.overrides.runtime_key(key) is not None:
            return MISSING, "runtime"
        if key in self.detection.config_values:
            return self.detection.config_values[key], "config"
        if key in FOLLOWS:
            return self.value(FOLLOWS[key])
        if self.detection.fully_async and key in FULLY_ASYNC_DEFAULTS:
            return FULLY_ASYNC_DEFAULTS[key], "default"
        if key in DEFAULTS:
            return DEFAULTS[key], "default"
        return None, "default"

    def int_value(self, key: str) -> int | None:
        value, _ = self.value(key)
        if isinstance(value, bool) or value is MISSING:
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return None


@dataclass
class Requirements:
    settings: list[Setting] = field(default_factory=list)
    env: list[EnvVar] = field(default_factory=list)
    configs: list[ConfigSpec] = field(default_factory=list)
    patch_sets: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)  # not fixable by an override
    checks: list[Callable[[Context, Requirements], tuple[list[Violation], list[str]]]] = field(
        default_factory=list
    )
    notes: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    removals: list[tuple[str, str]] = field(default_factory=list)  # (key, why): keys prepare takes out
    decided: list[str] = field(
        default_factory=list
    )  # flags the mode chose itself (the derived header says them)

    def add(self, *settings: Setting) -> None:
        for setting in settings:
            self.settings = [s for s in self.settings if s.key != setting.key]
            self.settings.append(setting)


def is_true(value: object) -> bool:
    """True as verl reads a bool from a script: `True`, or the text true in any case."""
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def is_false(value: object) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() == "false")


def is_abs_path(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and os.path.isabs(value)


def _describe(value: Any, origin: str) -> str:
    if origin == "default":
        return f"not set (verl's default: {format_value(value)})"
    if origin == "config":
        return f"not set in the script (the config gives {format_value(value)})"
    return format_value(value)


@dataclass
class CheckResult:
    violations: list[Violation]
    unverifiable: list[str]
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations


def check_requirements(ctx: Context, req: Requirements) -> CheckResult:
    """Evaluate the requirements on the script."""
    result = CheckResult(list(req.violations), list(req.unverifiable), [])
    for setting in req.settings:
        _check_setting(ctx, setting, result)
    for env in req.env:
        _check_env(ctx, env, result)
    for extra in req.checks:
        more, unknown = extra(ctx, req)
        result.violations.extend(more)
        result.unverifiable.extend(unknown)
    more, unknown, warned = _config_file_checks(ctx, req)
    result.violations.extend(more)
    result.unverifiable.extend(unknown)
    result.warnings.extend(warned)
    _check_command(ctx, req, result)
    return CheckResult(result.violations, _unique(result.unverifiable), _unique(result.warnings))


def _check_setting(ctx: Context, setting: Setting, result: CheckResult) -> None:
    """A Hydra key: the script's override, else verl's default (or the config's value) must do."""
    found = ctx.overrides.get(setting.key)
    if found is None:
        runtime = ctx.overrides.runtime_key(setting.key)
        if runtime is not None:
            result.unverifiable.append(f"{setting.key}: {runtime.problem}")
            return
        value, origin = ctx.value(setting.key)
        if setting.accepts(value) and origin in ("default", "config"):
            return
        result.violations.append(
            Violation(
                setting.rule,
                setting.key,
                _describe(value, origin),
                setting.required_text,
                f"add {setting.token} ({setting.why})",
            )
        )
        return
    if not setting.accepts(found.value):
        result.violations.append(
            Violation(
                setting.rule,
                setting.key,
                format_value(found.value),
                setting.required_text,
                f"set {setting.token} ({setting.why})",
            )
        )


def _check_env(ctx: Context, env: EnvVar, result: CheckResult) -> None:
    """An environment variable: exported by the script or passed to Ray's workers (as a string)."""
    via_ray = ctx.overrides.get(env.ray_key)
    exported = None
    if ctx.script.command is not None:
        for item in reversed(ctx.script.command.env):
            if item.name == env.name:
                exported = item
                break
    ray_ok = via_ray is not None and env.accepts(str(via_ray.value))
    if via_ray is not None and not isinstance(via_ray.value, str):
        result.violations.append(
            Violation(
                env.rule,
                env.ray_key,
                format_value(via_ray.value),
                f'"{env.value}" (a string)',
                f"quote the value for Hydra: '++{env.ray_key}=\"{env.value}\"' — Ray refuses non-string env_vars",
            )
        )
        return
    export_ok = exported is not None and env.accepts(exported.value.text)
    if exported is not None and not exported.value.known:
        result.unverifiable.append(f"{env.name}: {'; '.join(exported.value.runtime)}")
        return
    if ray_ok or export_ok:
        if env.workers and not ray_ok:
            result.unverifiable.append(
                f"{env.name} is exported but not in {RAY_ENV_PREFIX}*: it reaches the Ray workers only when "
                "this job starts its own Ray cluster (not with `ray start` beforehand or a Ray job submission)"
            )
        return
    found_text = (
        exported.value.text
        if exported is not None
        else str(via_ray.value)
        if via_ray is not None
        else "not set"
    )
    if not env.required:
        result.warnings.append(f"{env.name}={env.value} is recommended ({env.why}); found: {found_text}")
        return
    result.violations.append(
        Violation(
            env.rule,
            env.name,
            found_text or "",
            env.value,
            f"export {env.name}={env.value} and add '++{env.ray_key}=\"{env.value}\"' ({env.why})",
        )
    )


def _check_command(ctx: Context, req: Requirements, result: CheckResult) -> None:
    """What the command line itself hides or breaks: Ray job submission, "$@", sweeps, bad overrides."""
    command = ctx.script.command
    if command is not None and req.env and any(w.literal() == "submit" for w in command.prefix_words):
        result.unverifiable.append(
            "the job goes through `ray job submit`: also put the environment variables into its --runtime-env / "
            "--runtime-env-json, since Ray may give the submission's runtime_env precedence over ray.init's"
        )
    if ctx.script.command is not None and ctx.script.command.extra_args:
        result.unverifiable.append(
            'the command passes the script\'s own arguments ("$@"): overrides given at run time are not checked'
        )
    for item in ctx.overrides.items:
        if item.override is not None and item.override.sweep:
            result.violations.append(
                Violation(
                    "hydra.sweep",
                    item.override.key,
                    item.arg.value.text or "",
                    "one value",
                    f"verl does not run Hydra sweeps: write a list as {item.override.key}=[a,b] or quote a string "
                    f"as {item.override.key}='a,b'",
                )
            )
    for item in ctx.overrides.invalid:
        result.violations.append(
            Violation(
                "hydra.syntax",
                item.arg.word.raw,
                item.arg.value.text or "",
                "a valid Hydra override",
                item.problem or "",
            )
        )


def _config_file_checks(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str], list[str]]:
    """Validate the msprobe configs the script points at (when this machine can read them)."""
    from rl_msprobe.planner import msprobe_config

    violations: list[Violation] = []
    unverifiable: list[str] = []
    warnings: list[str] = []
    for spec in req.configs:
        path: Any = None
        where = spec.setting_key or spec.env_name or spec.role
        if spec.setting_key:
            found = ctx.overrides.get(spec.setting_key)
            path = found.value if found is not None else None
        if path is None and spec.env_name:
            path = env_in_script(ctx, spec.env_name)
        if not isinstance(path, str) or not os.path.isabs(path):
            continue  # the setting's own rule reports a missing or relative path
        doc, problem = msprobe_config.load(path)
        if doc is None:
            unverifiable.append(f"{where}: {problem}")
            continue
        for item in msprobe_config.validate(doc, spec.role):
            if item.severity == "warning":
                warnings.append(f"{path}: {item.key}: {item.message}")
            else:
                violations.append(
                    Violation(
                        f"msprobe_config.{spec.role}",
                        f"{path}:{item.key}",
                        json.dumps(doc.get(item.key))
                        if isinstance(doc, dict) and item.key in doc
                        else "not set",
                        f"a valid {spec.role} config",
                        f"edit {path}: {item.message}",
                    )
                )
    return violations, unverifiable, warnings


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def too_old(ctx: Context, rule: str, project: str, minimum: str, fix: str) -> Violation | None:
    """A violation when the detected version of project is below minimum (None when fine or unknown)."""
    version = ctx.version(project)
    if version is None or version >= Version(minimum):
        return None
    return Violation(rule, project, str(version), f">= {minimum}", fix)


def env_in_script(ctx: Context, name: str) -> str | None:
    return env_value(ctx.script, ctx.overrides, name)

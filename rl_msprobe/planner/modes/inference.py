"""Inference (rollout) collection: dump the rollout engine's forward passes.

Rules (specification path B; DOMAIN §1, §4, §5):
- `actor_rollout_ref.rollout.enforce_eager=True` always (never dump with graphs on);
  `TORCHDYNAMO_DISABLE=1` recommended.
- vLLM: `++actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config_path`
  — only vLLM-Ascend reads it (0.12.0rc1 calls it `dump_config`, ≤ 0.11 has no msprobe
  support); upstream GPU vLLM ignores it and needs the `vllm-dump` patch, which reads
  `MSPROBE_ROLLOUT_CONFIG` and is wired into whichever model runners the tree has (V1, V2 or
  both), so no runner setting is needed. With the vLLM tree known (`--tree` / `--python`): a
  tree with no runner the patch can be wired into is refused (no dump path), and a script that
  exports `VLLM_USE_V2_MODEL_RUNNER=0` for a tree without the V1 runner (vLLM 0.34 refuses it at
  start-up) gets `1` instead.
- SGLang ≥ 0.5.11: `++actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config`;
  older: the `sglang-dump` patch (reads `MSPROBE_ROLLOUT_CONFIG`, or `MSPROBE_PREFILL_CONFIG`
  / `MSPROBE_DECODE_CONFIG` with PD disaggregation) and that key must not be set.
  Unknown version: assume the newest release and say what an older one needs.
- PD disaggregation: `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`.
- the config sets `dump_path` (absolute); vLLM and SGLang methods are never mixed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from packaging.version import Version

from rl_msprobe.planner.modes.base import (
    ConfigSpec,
    Context,
    Requirements,
    Violation,
    env_in_script,
    is_abs_path,
    is_true,
)
from rl_msprobe.planner.modes.rules import Condition, EnvRule, From, Rule, apply
from rl_msprobe.upstream.projects import project

VLLM_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config_path"
VLLM_KEY_0_12 = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dump_config"
SGLANG_KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config"
SGLANG_NATIVE = Version("0.5.11")
ROLLOUT_ENV = "MSPROBE_ROLLOUT_CONFIG"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _generate_path(ctx: Context) -> str:
    return os.path.join(ctx.config_dir, "config_generate.json")


def _ascend(ctx: Context) -> Version | None:
    return ctx.version("vllm-ascend")


def _upstream_vllm(ctx: Context) -> bool:
    """trainer.device=cuda|cpu without vLLM-Ascend: vLLM's own model runner runs, which ignores
    additional_config (the vllm-dump patch reads the config from the environment instead)."""
    return ctx.detection.device in ("gpu", "cpu") and _ascend(ctx) is None


def _vllm_key(ctx: Context) -> str:
    """vLLM-Ascend 0.12 reads additional_config.dump_config; 0.13 renamed it dump_config_path."""
    ascend = _ascend(ctx)
    if ascend is not None and Version("0.12.0rc1") <= ascend < Version("0.13.0rc1"):
        return VLLM_KEY_0_12
    return VLLM_KEY


def _sglang_native(ctx: Context) -> bool:
    """SGLang >= 0.5.11 (or unknown: the newest is assumed) reads msprobe_dump_config itself."""
    version = ctx.version("sglang")
    return version is None or version >= SGLANG_NATIVE


def _pd(ctx: Context) -> bool:
    return bool(ctx.options.pd if ctx.options.pd is not None else ctx.detection.pd_disaggregation)


def _writes_vllm_key(key: str) -> Condition:
    """vLLM-Ascend runs (it reads additional_config) and its release reads this key."""
    return lambda ctx: not _upstream_vllm(ctx) and _vllm_key(ctx) == key


def _patched_vllm(ctx: Context) -> bool:
    """Not on Ascend: upstream vLLM runs, and the vllm-dump patch is what dumps."""
    return ctx.detection.device != "npu" and _ascend(ctx) is None


def _no_v1_runner(ctx: Context) -> bool:
    """The vLLM tree that runs is known and has no V1 model runner (vLLM 0.34.0 and later)."""
    shape = ctx.vllm_runners if _patched_vllm(ctx) else None
    return shape is not None and not shape.has_v1


def _role_path(role: str) -> Callable[[Context], str]:
    return lambda ctx: os.path.join(ctx.config_dir, f"config_{role}.json")


ROLLOUT: tuple[Rule | EnvRule, ...] = (
    Rule(
        "inference.enforce_eager",
        "actor_rollout_ref.rollout.enforce_eager",
        True,
        "never dump with CUDA/ACL graphs on: the rollout must run eagerly",
        accept=is_true,
    ),
    EnvRule(
        "inference.torchdynamo",
        "TORCHDYNAMO_DISABLE",
        "1",
        "torch.compile would hide modules from msprobe",
        required=False,
    ),
)

VLLM: tuple[Rule | EnvRule, ...] = (
    *(
        Rule(
            "inference.vllm_dump_config",
            key,
            From(_generate_path),
            "vLLM-Ascend starts msprobe from additional_config; engine_kwargs.vllm is {} by default, so ++ "
            "is needed",
            when=_writes_vllm_key(key),
            prefix="++",
            accept=is_abs_path,
            required="an absolute path to the generate config",
        )
        for key in (VLLM_KEY, VLLM_KEY_0_12)
    ),
    EnvRule(
        "inference.vllm_gpu_config",
        ROLLOUT_ENV,
        _generate_path,
        "read by the vllm-dump patch in upstream (GPU) vLLM's model runner",
        required=_upstream_vllm,
        accept=os.path.isabs,
    ),
    EnvRule(
        "inference.vllm_runner_setting",
        V2_ENV,
        "1",
        lambda ctx: (
            f"this vLLM has no V1 model runner and refuses {V2_ENV}={env_in_script(ctx, V2_ENV)} at start-up; "
            "vllm-dump is wired into its V2 runner"
        ),
        when=lambda ctx: _no_v1_runner(ctx) and env_in_script(ctx, V2_ENV) not in (None, "1"),
    ),
)

SGLANG: tuple[Rule | EnvRule, ...] = (
    Rule(
        "inference.sglang_dump_config",
        SGLANG_KEY,
        From(_generate_path),
        "SGLang >= 0.5.11 starts msprobe from ServerArgs.msprobe_dump_config (forces CUDA graphs off)",
        when=_sglang_native,
        prefix="++",
        accept=is_abs_path,
        required="an absolute path to the generate config",
    ),
    *(
        EnvRule(
            f"inference.sglang_{role}_config",
            env_name,
            _role_path(role),
            f"read by the sglang-dump patch in the {role} server (server_args.disaggregation_mode)",
            when=lambda ctx: not _sglang_native(ctx) and _pd(ctx),
            accept=os.path.isabs,
        )
        for role, env_name in (("prefill", "MSPROBE_PREFILL_CONFIG"), ("decode", "MSPROBE_DECODE_CONFIG"))
    ),
    EnvRule(
        "inference.sglang_patch_config",
        ROLLOUT_ENV,
        _generate_path,
        lambda ctx: (
            f"read by the sglang-dump patch (SGLang {ctx.version('sglang')} < 0.5.11 has no msprobe_dump_config)"
        ),
        when=lambda ctx: not _sglang_native(ctx) and not _pd(ctx),
        accept=os.path.isabs,
    ),
    EnvRule(
        "inference.sglang_pd_health",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        "0",
        "health-check generations would be dumped as if they were rollout requests",
        when=_pd,
    ),
)


def _rollout_found(ctx: Context) -> str:
    """What the script (or its config) sets actor_rollout_ref.rollout.name to, as the violation says it."""
    if ctx.detection.rollout != "unknown":
        return ctx.detection.rollout
    value, origin = ctx.value("actor_rollout_ref.rollout.name")
    if origin == "runtime":
        return "set at run time"
    return "not set" if value is None or value == "???" else str(value)


def rollout_requirements(ctx: Context, req: Requirements, role_dir: str = "generate") -> None:
    """Everything the rollout side needs; shared by inference and consistency."""
    rollout = ctx.rollout
    dump_root = os.path.join(ctx.dump_dir, role_dir)
    apply(ctx, req, ROLLOUT)
    if rollout not in ("vllm", "sglang"):
        req.violations.append(
            Violation(
                "inference.rollout_engine",
                "actor_rollout_ref.rollout.name",
                _rollout_found(ctx),
                "vllm or sglang",
                "set actor_rollout_ref.rollout.name=vllm|sglang in the script (verl needs it anyway) or pass --backend",
            )
        )
        return
    if rollout == "vllm":
        _vllm(ctx, req, dump_root)
    else:
        _sglang(ctx, req, dump_root)
    req.checks.append(_no_mixing)
    for key in _other_engine_keys(ctx):
        if ctx.overrides.get(key) is not None:
            req.removals.append((key, f"a {ctx.rollout} rollout never uses the other engine's msprobe key"))


def _vllm(ctx: Context, req: Requirements, dump_root: str) -> None:
    ascend = _ascend(ctx)
    if ascend is not None and ascend < Version("0.12.0rc1"):
        req.violations.append(
            Violation(
                "inference.vllm_ascend_version",
                "vllm-ascend",
                str(ascend),
                ">= 0.12.0rc1",
                "vLLM-Ascend up to 0.11 has no msprobe support: upgrade vllm-ascend",
            )
        )
    elif ascend is not None and ascend < Version("0.13.0rc1"):
        req.notes.append(
            f"vLLM-Ascend {ascend} reads additional_config.dump_config (renamed dump_config_path in 0.13)."
        )
    upstream = _upstream_vllm(ctx)
    key = _vllm_key(ctx)
    req.configs.append(
        ConfigSpec("generate", "config_generate.json", dump_root, None if upstream else key, ROLLOUT_ENV)
    )
    apply(ctx, req, VLLM)
    if _patched_vllm(ctx):
        if not _dump_path(ctx, req):
            return
        req.patch_sets.append("vllm-dump")
        req.notes.append(
            "Upstream (GPU) vLLM has no msprobe support and ignores additional_config.dump_config_path: apply the "
            "vllm-dump patch to the vLLM tree that runs; it reads MSPROBE_ROLLOUT_CONFIG and is wired into "
            "whichever model runners the tree has (V1, V2 or both: either dumps), so no runner setting is needed. "
            "On Ascend (vLLM-Ascend) skip the patch: vLLM-Ascend reads dump_config_path itself."
            + (
                f" trainer.device={ctx.detection.device}: no vLLM-Ascend, so {key} is not set."
                if upstream
                else ""
            )
        )
    else:
        req.notes.append(
            "vLLM-Ascend reads additional_config.dump_config_path natively; no vLLM patch is needed."
        )


def _dump_path(ctx: Context, req: Requirements) -> bool:
    """Does the vLLM tree that runs have a model runner vllm-dump can be wired into? (True when the
    tree is unknown: the newest release is assumed.) A tree without one is a violation: no derived
    script, since the job could not dump."""
    shape = ctx.vllm_runners
    if shape is None:
        return True
    version = ctx.versions.get("vllm") or "(version unknown)"
    if shape.dumped:
        req.notes.append(f"vLLM {version}: vllm-dump is wired into {' and '.join(shape.dumped)}.")
        return True
    req.violations.append(
        Violation(
            "inference.vllm_dump_path",
            "vllm",
            f"vLLM {version} at {ctx.vllm_root}: " + "; ".join(shape.skipped),
            "a model runner vllm-dump can patch (V1 vllm/v1/worker/gpu_model_runner.py or V2 "
            "vllm/v1/worker/gpu/model_runner.py)",
            "no rollout dump path exists for this vLLM tree: this rl-msprobe knows no model runner of it. "
            "Update rl-msprobe, or run a vLLM release it supports (rl-msprobe patch list).",
        )
    )
    return False


def _sglang(ctx: Context, req: Requirements, dump_root: str) -> None:
    version = ctx.version("sglang")
    pd, native = _pd(ctx), _sglang_native(ctx)
    if version is None:
        req.notes.append(
            f"SGLang version unknown: assuming the newest release ({project('sglang').assumed_version}), which reads "
            "msprobe_dump_config natively. SGLang < 0.5.11 rejects that key (TypeError): there, drop it, apply "
            f"the sglang-dump patch and set {ROLLOUT_ENV} instead (pass --tree/--python to detect the version)."
        )
    if native:
        req.configs.append(ConfigSpec("generate", "config_generate.json", dump_root, SGLANG_KEY))
        if pd:
            # verl gives the prefill and decode servers one engine_kwargs.sglang: one config, and
            # both are rank 0 of their own server, so both would write step{N}/rank0 under one dump_path
            req.patch_sets.append("sglang-pd-dump-path")
            req.notes.append(
                "PD disaggregation with native msprobe: prefill and decode servers get the same "
                "msprobe_dump_config and would both write step{N}/rank0 under one dump_path; the "
                "sglang-pd-dump-path patch gives each role its folder (<dump_path>/prefill, <dump_path>/decode)."
            )
    else:
        req.patch_sets.append("sglang-dump")
        req.checks.append(_no_native_key_below_0_5_11)
        if ctx.overrides.get(SGLANG_KEY) is not None:
            req.removals.append((SGLANG_KEY, f"SGLang {version} has no msprobe_dump_config"))
        for role, env_name in (("prefill", "MSPROBE_PREFILL_CONFIG"), ("decode", "MSPROBE_DECODE_CONFIG")):
            if pd:
                req.configs.append(
                    ConfigSpec(role, f"config_{role}.json", os.path.join(dump_root, role), None, env_name)
                )
        if not pd:
            req.configs.append(ConfigSpec("generate", "config_generate.json", dump_root, None, ROLLOUT_ENV))
    apply(ctx, req, SGLANG)
    if pd:
        req.notes.append(
            "PD + data parallel: the optional sglang-bootstrap-room patch (SGLang >= 0.5.2) pins bootstrap_room for "
            "reproducible routing: apply it and export MSPROBE_BOOTSTRAP_ROOM=<N> for the rollout. It pins batched "
            "requests only (SGLang normalises bootstrap parameters for batches); single requests, which verl "
            "sends, keep the room their router gives them."
        )
    dp = ctx.int_value("actor_rollout_ref.rollout.data_parallel_size")
    if dp is not None and dp > 1 and not native:
        req.notes.append(
            "SGLang --dp-size > 1: the sglang-dump patch passes rank_id=gpu_id so ranks do not collide."
        )


def _no_native_key_below_0_5_11(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str]]:
    found = ctx.overrides.get(SGLANG_KEY)
    if found is None:
        return [], []
    return [
        Violation(
            "inference.sglang_version",
            SGLANG_KEY,
            str(found.value),
            "not set",
            f"SGLang {ctx.versions.get('sglang')} has no msprobe_dump_config (TypeError): remove it and use the "
            f"sglang-dump patch with {ROLLOUT_ENV}",
        )
    ], []


def _other_engine_keys(ctx: Context) -> list[str]:
    return [SGLANG_KEY] if ctx.rollout == "vllm" else [VLLM_KEY, VLLM_KEY_0_12]


def _no_mixing(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str]]:
    out = []
    for key in _other_engine_keys(ctx):
        found = ctx.overrides.get(key)
        if found is not None:
            out.append(
                Violation(
                    "inference.no_mixing",
                    key,
                    str(found.value),
                    "not set",
                    f"the rollout engine is {ctx.rollout}: remove {key} (never mix vLLM and SGLang collection)",
                )
            )
    return out, []


def requirements(ctx: Context) -> Requirements:
    req = Requirements()
    rollout_requirements(ctx, req)
    return req

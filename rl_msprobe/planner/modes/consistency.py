"""Training–inference consistency (训推一致性): the same prompts' prefill, dumped once in the
rollout engine and once in the (patched) training engine, compared layer by layer.

Rules (specification path C; DOMAIN §1): everything of inference, plus
- env `DUMP_ON=1 PROMPTS_ONLY=1 DUMP_PHASE=log_prob TORCHDYNAMO_DISABLE=1
  MSPROBE_ACTOR_CONFIG=<actor config>` reaching the Ray workers;
- batch: train / mini / micro batch = 1, `rollout.n` = DP (DP = world size / SP), Ulysses SP = 1
  for actor and ref (FSDP);
- parallel alignment: FSDP — rollout TP = rollout devices, rollout DP = 1; Megatron — actor
  (and ref) TP / PP / EP equal the rollout's TP / PP / EP item by item;
- one request per rollout prefill, run in full: `rollout.max_num_seqs=1` (the n samples of a
  prompt are otherwise prefilled together in one step) and `rollout.enable_prefix_caching=False`
  (a later sample's prefill is otherwise a cache hit covering only the last tokens);
- `trainer.val_before_train=False`, `trainer.balance_batch=False`,
  `actor.use_dynamic_bsz=False`, `model.use_remove_padding=True`;
- dtype (FSDP): the actor's forward computes in FSDP mixed precision's `param_dtype` (bf16
  unless `fsdp_config.mixed_precision` says otherwise; `fsdp_config.dtype` does not change
  it), so `param_dtype` must be the rollout's `dtype`, else every layer differs by rounding;
- verl ≥ 0.7.0 (in 0.6.x the actor always runs the legacy workers: the patched engine never
  computes its log-probs); 0.7.x needs `trainer.use_legacy_worker_impl=disable`;
- patch sets: `verl-consistency` on verl, plus the rollout side's (sglang-dump below 0.5.11,
  vllm-dump on GPU vLLM, vllm-ascend-dispatch-log recommended on vLLM-Ascend);
- SGLang: `sglang-dispatch-log` (which requests each dumped forward pass served: the rollout
  side of the request-id join) and `engine_kwargs.sglang.disable_radix_cache=True` (verl's
  SGLang server does not pass `enable_prefix_caching` on).

The specification words the Megatron rule as "TP/PP/EP = rollout TP/DP/EP"; verl's rollout has
its own `pipeline_model_parallel_size`, and only equal PP makes training rank r hold the same
layers as inference rank r, so PP is paired with the rollout's PP here.
"""

from __future__ import annotations

import os
from typing import Any

from packaging.version import Version

from rl_msprobe.planner.modes.base import (
    MISSING,
    ConfigSpec,
    Context,
    EnvVar,
    Requirements,
    Setting,
    Violation,
    too_old,
)
from rl_msprobe.planner.modes.inference import rollout_requirements

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
MEGATRON_PAIRS = (
    ("tensor_model_parallel_size", "tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "pipeline_model_parallel_size"),
    ("expert_model_parallel_size", "expert_parallel_size"),
)


def _false(value: Any) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() == "false")


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


# verl's / vLLM's names for a dtype -> the FSDP mixed-precision name (verl's PrecisionType).
_PRECISION = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "16": "fp16",
}
PARAM_DTYPE = A + "fsdp_config.mixed_precision.param_dtype"


def precision(value: Any) -> str | None:
    """'bf16' / 'fp32' / 'fp16' for a dtype as verl or vLLM spells it; None when unknown ('auto')."""
    return _PRECISION.get(str(value).strip().lower().removeprefix("torch."))


def _dtype_alignment(ctx: Context, req: Requirements) -> None:
    """FSDP: the actor's mixed-precision param dtype = the rollout's dtype."""
    value, origin = ctx.value(R + "dtype")
    rollout = precision(value) if origin != "runtime" else None
    if rollout is None:
        req.unverifiable.append(
            f"{R}dtype is {value if origin != 'runtime' else 'only known at run time'}: cannot align "
            f"{PARAM_DTYPE} with it"
        )
        return
    req.add(
        Setting(
            "consistency.dtype.param_dtype",
            PARAM_DTYPE,
            rollout,
            "++",
            f"the actor's FSDP forward computes in mixed_precision.param_dtype (bf16 unless set; "
            f"fsdp_config.dtype does not change it): it must be the rollout's dtype ({value})",
            accept=lambda found: precision("bf16" if found is None else found) == rollout,
        )
    )


def world_sizes(ctx: Context) -> tuple[int | None, int | None]:
    """(training devices, rollout devices); None where the script leaves it to run time."""
    gpus, nodes = ctx.int_value("trainer.n_gpus_per_node"), ctx.int_value("trainer.nnodes")
    train = gpus * nodes if gpus is not None and nodes is not None else None
    if ctx.detection.fully_async:
        rgpus, rnodes = ctx.int_value("rollout.n_gpus_per_node"), ctx.int_value("rollout.nnodes")
        return train, (rgpus * rnodes if rgpus is not None and rnodes is not None else None)
    return train, train


def requirements(ctx: Context) -> Requirements:
    req = Requirements()
    rollout_requirements(ctx, req)
    actor_path = os.path.join(ctx.config_dir, "config_actor.json")
    req.configs.append(
        ConfigSpec(
            "actor", "config_actor.json", os.path.join(ctx.dump_dir, "actor"), None, "MSPROBE_ACTOR_CONFIG"
        )
    )
    # TORCHDYNAMO_DISABLE is required here, not only recommended
    req.env = [e for e in req.env if e.name != "TORCHDYNAMO_DISABLE"]
    for name, value, why in (
        ("DUMP_ON", "1", "switches the patched verl engine's dump hooks on"),
        (
            "PROMPTS_ONLY",
            "1",
            "the actor also runs (and dumps) a prompts-only copy of each batch: the rollout's prefill",
        ),
        ("DUMP_PHASE", "log_prob", "dump the log-prob forward (the prefill), not the update"),
        ("TORCHDYNAMO_DISABLE", "1", "torch.compile would hide modules from msprobe"),
    ):
        req.env.append(EnvVar(f"consistency.env.{name}", name, value, why))
    req.env.append(
        EnvVar(
            "consistency.env.MSPROBE_ACTOR_CONFIG",
            "MSPROBE_ACTOR_CONFIG",
            actor_path,
            "the patched engine's msprobe config (with dump_path)",
            accept=os.path.isabs,
        )
    )

    if ctx.detection.device != "npu":
        req.env.append(
            EnvVar(
                "consistency.env.CUBLAS_WORKSPACE_CONFIG",
                "CUBLAS_WORKSPACE_CONFIG",
                ":4096:8",
                "the verl-engine helper calls msprobe's seed_all(mode=True), i.e. "
                "torch.use_deterministic_algorithms(True); cuBLAS then raises without this",
                required=False,
            )
        )
        req.notes.append(
            "The engine helper makes torch deterministic (DUMP_DETERMINISTIC=1, msprobe seed_all): a "
            "non-deterministic kernel then raises. CUBLAS_WORKSPACE_CONFIG=:4096:8 is set for cuBLAS; if another "
            "op still raises, export DUMP_DETERMINISTIC=0 (seed only)."
        )
    verl = ctx.version("verl")
    no_engine = too_old(
        ctx,
        "consistency.verl_version",
        "verl",
        "0.7.0",
        "in verl before 0.7 the actor always runs the legacy workers (use_legacy_worker_impl switches only "
        "the critic and the reward model), so the patched engine never computes the actor's log-probs: upgrade verl",
    )
    if no_engine is not None:
        req.violations.append(no_engine)
    elif verl is not None and verl < Version("0.8.0"):
        req.add(
            Setting(
                "consistency.engine_workers",
                "trainer.use_legacy_worker_impl",
                "disable",
                "",
                f"verl {verl} runs the legacy workers by default; the patched engine runs only with this",
            )
        )

    fully_async = ctx.detection.fully_async
    batch: list[tuple[str, Any, str]] = [
        (
            "data.train_batch_size",
            0 if fully_async else 1,
            "one prompt per step" if not fully_async else "fully-async requires 0",
        ),
        (A + "ppo_mini_batch_size", 1, "one prompt per mini-batch"),
        (
            A + "ppo_micro_batch_size_per_gpu",
            1,
            "one sequence per micro-batch, so a dump step is one request",
        ),
        (R + "log_prob_micro_batch_size_per_gpu", 1, "one sequence per log-prob micro-batch"),
        (REF + "log_prob_micro_batch_size_per_gpu", 1, "one sequence per ref micro-batch"),
        (A + "use_dynamic_bsz", False, "dynamic batching regroups sequences"),
        (
            "actor_rollout_ref.model.use_remove_padding",
            True,
            "the engine patch expects packed (unpadded) inputs",
        ),
        ("trainer.val_before_train", False, "validation generations would be dumped first"),
        (
            R + "max_num_seqs",
            1,
            "one request per rollout model step: the n samples of a prompt reach the engine together and "
            "would otherwise be prefilled in one step, which pairs with no single training micro-batch",
        ),
        (
            R + "enable_prefix_caching",
            False,
            "every dumped prefill runs the whole prompt: with prefix caching a later sample of the same "
            "prompt is a cache hit whose forward covers only the last tokens",
        ),
        ("trainer.balance_batch", False, "balancing reorders sequences across ranks"),
    ]
    if fully_async:
        batch.append(("async_training.require_batches", 1, "one batch per training step"))
    if fully_async or ctx.overrides.get("algorithm.rollout_correction.bypass_mode") is not None:
        batch.append(
            (
                "algorithm.rollout_correction.bypass_mode",
                False,
                "bypass mode (fully-async's default) reuses the rollout's log-probs: the training log-prob forward "
                "would never run",
            )
        )
    for key, value, why in batch:
        accept = _false if value is False else _true if value is True else None
        req.add(Setting(f"consistency.batch.{key.rsplit('.', 1)[-1]}", key, value, "", why, accept=accept))

    train_world, rollout_world = world_sizes(ctx)
    if ctx.backend not in ("fsdp", "megatron"):
        req.violations.append(
            Violation(
                "consistency.train_backend",
                "model_engine",
                ctx.backend,
                "fsdp or megatron",
                "the engine patch covers the FSDP and Megatron engines: say which one runs with --train-backend",
            )
        )
        return req
    if ctx.backend == "megatron":
        dp = None
        tp = ctx.int_value(A + "megatron.tensor_model_parallel_size")
        pp = ctx.int_value(A + "megatron.pipeline_model_parallel_size")
        cp = ctx.int_value(A + "megatron.context_parallel_size") or 1
        for actor_key, rollout_key in MEGATRON_PAIRS:
            size = ctx.int_value(A + "megatron." + actor_key)
            if size is None:
                req.unverifiable.append(
                    f"{A}megatron.{actor_key} is only known at run time: cannot align {R}{rollout_key}"
                )
                continue
            req.add(
                Setting(
                    f"consistency.parallel.{rollout_key}",
                    R + rollout_key,
                    size,
                    "",
                    f"Megatron: the rollout's {rollout_key} must equal the actor's {actor_key}",
                )
            )
            if ctx.overrides.get(REF + "megatron." + actor_key) is not None:
                # the ref copies the actor's sizes unless the script sets its own
                req.add(
                    Setting(
                        f"consistency.parallel.ref_{actor_key}",
                        REF + "megatron." + actor_key,
                        size,
                        "",
                        f"Megatron: the ref's {actor_key} must equal the actor's",
                    )
                )
        if train_world is not None and tp and pp:
            dp = train_world // (tp * pp * cp)
    else:
        for key in (
            A + "ulysses_sequence_parallel_size",
            A + "fsdp_config.ulysses_sequence_parallel_size",
            REF + "ulysses_sequence_parallel_size",
        ):
            req.add(Setting("consistency.batch.sp", key, 1, "", "Ulysses SP splits a sequence across ranks"))
        _dtype_alignment(ctx, req)
        dp = train_world
        if rollout_world is not None:
            req.add(
                Setting(
                    "consistency.parallel.rollout_tp",
                    R + "tensor_model_parallel_size",
                    rollout_world,
                    "",
                    f"FSDP: rollout TP = the {rollout_world} rollout devices, so inference rank r matches training rank r",
                )
            )
            req.add(
                Setting(
                    "consistency.parallel.rollout_dp",
                    R + "data_parallel_size",
                    1,
                    "",
                    "FSDP: one rollout replica",
                )
            )
        else:
            req.unverifiable.append(
                "the number of rollout devices is only known at run time: cannot set rollout TP"
            )
    if dp is not None and dp >= 1:
        req.add(
            Setting(
                "consistency.batch.n",
                R + "n",
                dp,
                "",
                f"rollout.n = DP ({dp}) gives every training rank one sequence",
            )
        )
    else:
        req.unverifiable.append(
            "the data-parallel size is only known at run time: cannot set actor_rollout_ref.rollout.n"
        )

    req.patch_sets.insert(0, "verl-consistency")
    if ctx.rollout == "sglang":
        _sglang_pairing(req)
    if ctx.rollout == "vllm" and "vllm-dump" not in req.patch_sets:
        ascend = ctx.version("vllm-ascend")
        if ascend is None or ascend >= Version("0.12.0rc1"):
            req.notes.append(
                "vLLM-Ascend: the vllm-ascend-dispatch-log patch writes dispatch_log.jsonl, which links each "
                "inference prefill step to its request id (recommended for `rl-msprobe dumps correlate`)."
            )
    req.checks.append(_no_lora_ref_note)
    return req


SGLANG_RADIX = R + "engine_kwargs.sglang.disable_radix_cache"


def _sglang_pairing(req: Requirements) -> None:
    """SGLang: the dispatch log names each dumped forward pass's requests (the rollout half of
    `dumps correlate`), and the radix cache off: verl's SGLang server does not read
    rollout.enable_prefix_caching, so a later sample of a prompt would prefill from the cache."""
    req.patch_sets.append("sglang-dispatch-log")
    req.add(
        Setting(
            "consistency.sglang.radix_cache",
            SGLANG_RADIX,
            True,
            "++",
            "every dumped prefill runs the whole prompt: verl's SGLang server ignores "
            "rollout.enable_prefix_caching, and SGLang's radix cache would turn a later sample's prefill "
            "into a cache hit covering only the last tokens",
            accept=_true,
        )
    )


def _no_lora_ref_note(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str]]:
    value, origin = ctx.value("actor_rollout_ref.model.lora_rank")
    if origin == "script" and value not in (None, 0, "0") and value is not MISSING:
        return [], [
            "LoRA: the ref runs on the actor engine, so ref log-prob dumps come from the actor's engine"
        ]
    return [], []

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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from packaging.version import Version

from rl_msprobe.planner.modes.base import MISSING, ConfigSpec, Context, Requirements, Violation
from rl_msprobe.planner.modes.inference import rollout_requirements
from rl_msprobe.planner.modes.rules import Condition, EnvRule, From, Rule, VersionRule, apply, first_too_old

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
MEGATRON_PAIRS = (
    ("tensor_model_parallel_size", "tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "pipeline_model_parallel_size"),
    ("expert_model_parallel_size", "expert_parallel_size"),
)


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


def world_sizes(ctx: Context) -> tuple[int | None, int | None]:
    """(training devices, rollout devices); None where the script leaves it to run time."""
    gpus, nodes = ctx.int_value("trainer.n_gpus_per_node"), ctx.int_value("trainer.nnodes")
    train = gpus * nodes if gpus is not None and nodes is not None else None
    if ctx.detection.fully_async:
        rgpus, rnodes = ctx.int_value("rollout.n_gpus_per_node"), ctx.int_value("rollout.nnodes")
        return train, (rgpus * rnodes if rgpus is not None and rnodes is not None else None)
    return train, train


def _data_parallel_size(ctx: Context) -> int | None:
    """The training DP size (None when only known at run time): FSDP — every device; Megatron — world / (TP·PP·CP)."""
    train_world, _ = world_sizes(ctx)
    if ctx.backend == "megatron":
        tp = ctx.int_value(A + "megatron.tensor_model_parallel_size")
        pp = ctx.int_value(A + "megatron.pipeline_model_parallel_size")
        cp = ctx.int_value(A + "megatron.context_parallel_size") or 1
        dp = train_world // (tp * pp * cp) if train_world is not None and tp and pp else None
    else:
        dp = train_world
    return dp if dp is not None and dp >= 1 else None


def _rollout_precision(ctx: Context) -> str | None:
    value, origin = ctx.value(R + "dtype")
    return precision(value) if origin != "runtime" else None


def _rollout_dtype_text(ctx: Context) -> str:
    value, origin = ctx.value(R + "dtype")
    return str(value) if origin != "runtime" else "only known at run time"


def _fully_async(ctx: Context) -> bool:
    return ctx.detection.fully_async


def _megatron(ctx: Context) -> bool:
    return ctx.backend == "megatron"


def _fsdp(ctx: Context) -> bool:
    return ctx.backend == "fsdp"


def engine_workers_off_by_default(ctx: Context) -> bool:
    """verl 0.7.x: the engine workers exist but the legacy ones run unless the script says otherwise."""
    verl = ctx.version("verl")
    return verl is not None and Version("0.7.0") <= verl < Version("0.8.0")


def _actor_size(actor_key: str) -> Callable[[Context], int | None]:
    return lambda ctx: ctx.int_value(A + "megatron." + actor_key)


def _ref_sets(actor_key: str) -> Condition:
    # the ref copies the actor's sizes unless the script sets its own
    return lambda ctx: _megatron(ctx) and ctx.overrides.get(REF + "megatron." + actor_key) is not None


VERSIONS = (
    VersionRule(
        "consistency.verl_version",
        "verl",
        "0.7.0",
        "in verl before 0.7 the actor always runs the legacy workers (use_legacy_worker_impl switches only "
        "the critic and the reward model), so the patched engine never computes the actor's log-probs: upgrade verl",
    ),
)

ENV = (
    EnvRule("consistency.env.DUMP_ON", "DUMP_ON", "1", "switches the patched verl engine's dump hooks on"),
    EnvRule(
        "consistency.env.PROMPTS_ONLY",
        "PROMPTS_ONLY",
        "1",
        "the actor also runs (and dumps) a prompts-only copy of each batch: the rollout's prefill",
    ),
    EnvRule(
        "consistency.env.DUMP_PHASE",
        "DUMP_PHASE",
        "log_prob",
        "dump the log-prob forward (the prefill), not the update",
    ),
    # required here, not only recommended as in inference
    EnvRule(
        "consistency.env.TORCHDYNAMO_DISABLE",
        "TORCHDYNAMO_DISABLE",
        "1",
        "torch.compile would hide modules from msprobe",
    ),
    EnvRule(
        "consistency.env.MSPROBE_ACTOR_CONFIG",
        "MSPROBE_ACTOR_CONFIG",
        lambda ctx: os.path.join(ctx.config_dir, "config_actor.json"),
        "the patched engine's msprobe config (with dump_path)",
        accept=os.path.isabs,
    ),
    EnvRule(
        "consistency.env.CUBLAS_WORKSPACE_CONFIG",
        "CUBLAS_WORKSPACE_CONFIG",
        ":4096:8",
        "the verl-engine helper calls msprobe's seed_all(mode=True), i.e. "
        "torch.use_deterministic_algorithms(True); cuBLAS then raises without this",
        when=lambda ctx: ctx.detection.device != "npu",
        required=False,
    ),
)

# one prompt, one sequence, one request at a time, in the order verl received them
BATCH = (
    Rule(
        "consistency.batch.train_batch_size",
        "data.train_batch_size",
        1,
        "one prompt per step",
        when=lambda ctx: not _fully_async(ctx),
    ),
    Rule(
        "consistency.batch.train_batch_size",
        "data.train_batch_size",
        0,
        "fully-async requires 0",
        when=_fully_async,
    ),
    Rule("consistency.batch.ppo_mini_batch_size", A + "ppo_mini_batch_size", 1, "one prompt per mini-batch"),
    Rule(
        "consistency.batch.ppo_micro_batch_size_per_gpu",
        A + "ppo_micro_batch_size_per_gpu",
        1,
        "one sequence per micro-batch, so a dump step is one request",
    ),
    Rule(
        "consistency.batch.log_prob_micro_batch_size_per_gpu",
        R + "log_prob_micro_batch_size_per_gpu",
        1,
        "one sequence per log-prob micro-batch",
    ),
    Rule(
        "consistency.batch.log_prob_micro_batch_size_per_gpu",
        REF + "log_prob_micro_batch_size_per_gpu",
        1,
        "one sequence per ref micro-batch",
    ),
    Rule(
        "consistency.batch.use_dynamic_bsz",
        A + "use_dynamic_bsz",
        False,
        "dynamic batching regroups sequences",
    ),
    Rule(
        "consistency.batch.use_remove_padding",
        "actor_rollout_ref.model.use_remove_padding",
        True,
        "the engine patch expects packed (unpadded) inputs",
    ),
    Rule(
        "consistency.batch.val_before_train",
        "trainer.val_before_train",
        False,
        "validation generations would be dumped first",
    ),
    Rule(
        "consistency.batch.max_num_seqs",
        R + "max_num_seqs",
        1,
        "one request per rollout model step: the n samples of a prompt reach the engine together and "
        "would otherwise be prefilled in one step, which pairs with no single training micro-batch",
    ),
    Rule(
        "consistency.batch.enable_prefix_caching",
        R + "enable_prefix_caching",
        False,
        "every dumped prefill runs the whole prompt: with prefix caching a later sample of the same "
        "prompt is a cache hit whose forward covers only the last tokens",
    ),
    Rule(
        "consistency.batch.balance_batch",
        "trainer.balance_batch",
        False,
        "balancing reorders sequences across ranks",
    ),
    Rule(
        "consistency.batch.require_batches",
        "async_training.require_batches",
        1,
        "one batch per training step",
        when=_fully_async,
    ),
    Rule(
        "consistency.batch.bypass_mode",
        "algorithm.rollout_correction.bypass_mode",
        False,
        "bypass mode (fully-async's default) reuses the rollout's log-probs: the training log-prob forward "
        "would never run",
        when=lambda ctx: (
            _fully_async(ctx) or ctx.overrides.get("algorithm.rollout_correction.bypass_mode") is not None
        ),
    ),
)

# both plans: the actor's forward computes in the rollout's dtype
DTYPE = Rule(
    "consistency.dtype.param_dtype",
    PARAM_DTYPE,
    From(
        _rollout_precision,
        lambda ctx: f"{R}dtype is {_rollout_dtype_text(ctx)}: cannot align {PARAM_DTYPE} with it",
        same=lambda found, rollout: precision("bf16" if found is None else found) == rollout,
    ),
    lambda ctx, _: (
        "the actor's FSDP forward computes in mixed_precision.param_dtype (bf16 unless set; "
        f"fsdp_config.dtype does not change it): it must be the rollout's dtype ({ctx.value(R + 'dtype')[0]})"
    ),
    when=_fsdp,
    prefix="++",
)

# training rank r must hold what inference rank r holds: the same layers, the same shards
PARALLEL = (
    *(
        row
        for actor_key, rollout_key in MEGATRON_PAIRS
        for row in (
            Rule(
                f"consistency.parallel.{rollout_key}",
                R + rollout_key,
                From(
                    _actor_size(actor_key),
                    f"{A}megatron.{actor_key} is only known at run time: cannot align {R}{rollout_key}",
                ),
                f"Megatron: the rollout's {rollout_key} must equal the actor's {actor_key}",
                when=_megatron,
            ),
            Rule(
                f"consistency.parallel.ref_{actor_key}",
                REF + "megatron." + actor_key,
                From(_actor_size(actor_key)),  # unknown: the actor's row says so
                f"Megatron: the ref's {actor_key} must equal the actor's",
                when=_ref_sets(actor_key),
            ),
        )
    ),
    *(
        Rule("consistency.batch.sp", key, 1, "Ulysses SP splits a sequence across ranks", when=_fsdp)
        for key in (
            A + "ulysses_sequence_parallel_size",
            A + "fsdp_config.ulysses_sequence_parallel_size",
            REF + "ulysses_sequence_parallel_size",
        )
    ),
    DTYPE,
    Rule(
        "consistency.parallel.rollout_tp",
        R + "tensor_model_parallel_size",
        From(
            lambda ctx: world_sizes(ctx)[1],
            "the number of rollout devices is only known at run time: cannot set rollout TP",
        ),
        lambda ctx, world: (
            f"FSDP: rollout TP = the {world} rollout devices, so inference rank r matches training rank r"
        ),
        when=_fsdp,
    ),
    Rule(
        "consistency.parallel.rollout_dp",
        R + "data_parallel_size",
        1,
        "FSDP: one rollout replica",
        when=lambda ctx: _fsdp(ctx) and world_sizes(ctx)[1] is not None,
    ),
    Rule(
        "consistency.batch.n",
        R + "n",
        From(
            _data_parallel_size,
            "the data-parallel size is only known at run time: cannot set actor_rollout_ref.rollout.n",
        ),
        lambda ctx, dp: f"rollout.n = DP ({dp}) gives every training rank one sequence",
    ),
)


def requirements(ctx: Context) -> Requirements:
    """The plan at the job's own scale (the default), or the original skill's (--batch-one)."""
    if ctx.options.batch_one:
        return _batch_one(ctx)
    from rl_msprobe.planner.modes.consistency_job import job_requirements

    return job_requirements(ctx)


def _batch_one(ctx: Context) -> Requirements:
    """--batch-one: one request per dumped step, rollout TP = the devices (the original skill's plan)."""
    req = Requirements()
    rollout_requirements(ctx, req)
    req.configs.append(
        ConfigSpec(
            "actor", "config_actor.json", os.path.join(ctx.dump_dir, "actor"), None, "MSPROBE_ACTOR_CONFIG"
        )
    )
    apply(ctx, req, ENV)
    if ctx.detection.device != "npu":
        req.notes.append(
            "The engine helper makes torch deterministic (DUMP_DETERMINISTIC=1, msprobe seed_all): a "
            "non-deterministic kernel then raises. CUBLAS_WORKSPACE_CONFIG=:4096:8 is set for cuBLAS; if another "
            "op still raises, export DUMP_DETERMINISTIC=0 (seed only)."
        )
    no_engine = first_too_old(ctx, VERSIONS)
    if no_engine is not None:
        req.violations.append(no_engine)
    apply(
        ctx,
        req,
        [
            ENGINE_WORKERS,
            *BATCH,
        ],
    )
    if not backend_covered(ctx, req):
        return req
    apply(ctx, req, PARALLEL)
    req.patch_sets.insert(0, "verl-consistency")
    if ctx.rollout == "sglang":
        sglang_pairing(ctx, req)
    ascend_dispatch_note(ctx, req)
    tp = (world_sizes(ctx)[1] if _fsdp(ctx) else ctx.int_value(R + "tensor_model_parallel_size")) or None
    heads_fit_tp(ctx, req, tp)
    _dump_extent(ctx, req)
    _zoom(ctx, req)
    req.checks.append(no_lora_ref_note)
    return req


ENGINE_WORKERS = Rule(
    "consistency.engine_workers",
    "trainer.use_legacy_worker_impl",
    "disable",
    lambda ctx, _: (
        f"verl {ctx.version('verl')} runs the legacy workers by default; the patched engine runs only with this"
    ),
    when=engine_workers_off_by_default,
)


def backend_covered(ctx: Context, req: Requirements) -> bool:
    """FSDP or Megatron; otherwise a violation (the engine patch covers those two)."""
    if ctx.backend in ("fsdp", "megatron"):
        return True
    req.violations.append(
        Violation(
            "consistency.train_backend",
            "model_engine",
            ctx.backend,
            "fsdp or megatron",
            "the engine patch covers the FSDP and Megatron engines: say which one runs with --train-backend",
        )
    )
    return False


def ascend_dispatch_note(ctx: Context, req: Requirements) -> None:
    """vLLM-Ascend (a vLLM rollout without vllm-dump): the dispatch-log patch is recommended."""
    if ctx.rollout == "vllm" and "vllm-dump" not in req.patch_sets:
        ascend = ctx.version("vllm-ascend")
        if ascend is None or ascend >= Version("0.12.0rc1"):
            req.notes.append(
                "vLLM-Ascend: the vllm-ascend-dispatch-log patch writes dispatch_log.jsonl, which links each "
                "inference prefill step to its request id (recommended for `rl-msprobe dumps correlate`)."
            )


def heads_fit_tp(ctx: Context, req: Requirements, tp: int | None) -> None:
    """A rollout TP that does not divide the model's attention heads: vLLM and SGLang refuse to
    start (a violation naming the sizes that do), when config.json is readable here."""
    from rl_msprobe.planner import model_config

    value, origin = ctx.value(model_config.MODEL_KEY)
    found = model_config.read(value, origin, given=ctx.options.model_config)
    if tp is not None and found.model is None:  # said, never skipped silently
        req.unverifiable.append(
            f"{R}tensor_model_parallel_size={tp} divides the attention heads: {found.where}"
        )
    if tp is None or found.model is None or found.model.heads % tp == 0:
        return
    heads = found.model.heads
    valid = model_config.valid_tp(heads)
    req.violations.append(
        Violation(
            "consistency.parallel.tp_divides_heads",
            R + "tensor_model_parallel_size",
            str(tp),
            "one of " + ", ".join(str(v) for v in valid),
            f"the model has {heads} attention heads ({found.where}): a rollout TP of {tp} does not divide them "
            f"and vLLM / SGLang refuse to start; use a TP of {', '.join(str(v) for v in valid)}",
        )
    )


POSITIONS = EnvRule(
    "consistency.env.DUMP_POSITIONS",
    "DUMP_POSITIONS",
    "1",
    "the actor's log-prob forward over prompt + response records per-token statistics: every response "
    "position compared with its decode step (rl-msprobe dumps positions; --prefill-only: the prefill alone)",
    required=False,  # a script without it still runs a prefill-only consistency job
)
ROLLOUT_PHASES = EnvRule(
    "consistency.env.MSPROBE_ROLLOUT_PHASES",
    "MSPROBE_ROLLOUT_PHASES",
    "prefill",
    "--prefill-only: the vllm-dump helper dumps the prefill steps only (the decode steps are not compared)",
    required=False,
)
DEFAULT_MAX_DUMP_GIB = 50.0


def _zoom(ctx: Context, req: Requirements) -> None:
    """--zoom: msprobe mix dumps of one layer, one request, the prompt (modes/zoom.py)."""
    if ctx.options.zoom is not None:
        from rl_msprobe.planner.modes.zoom import apply_zoom

        apply_zoom(ctx, req, ctx.options.zoom)


def _model_layers(ctx: Context) -> tuple[int | None, str]:
    """(decoder layers of the actor's model, where they were read or why not): its config.json where the
    script points, the Hugging Face cache's copy of a hub id, or --model-config (planner/model_config.py)."""
    import json

    from rl_msprobe.planner import model_config

    value, origin = ctx.value(model_config.MODEL_KEY)
    given = ctx.options.model_config
    if given:
        config: str | None = os.path.join(given, "config.json") if os.path.isdir(given) else given
    else:
        config, why = model_config.locate(value, origin)
        if config is None:
            return None, why
    assert config is not None
    try:
        with open(config, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return None, f"{config} is not readable here"
    layers = doc.get("num_hidden_layers") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        layers = layers or doc["text_config"].get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        return None, f"{config} has no num_hidden_layers"
    return layers, config


def _dump_extent(ctx: Context, req: Requirements) -> None:
    """What the rollout and the actor dump per training step, and its size said before the job runs
    (refused past the limit). Whole response (the default): DUMP_POSITIONS=1, every rollout step.
    --prefill-only: no records, and on a vllm-dump rollout the prefill steps alone."""
    from rl_msprobe.dumps.position_size import GIB, whole_response

    prefill_only = ctx.options.prefill_only
    # the patched Megatron engine raises on DUMP_POSITIONS=1 (the FSDP engine alone records positions)
    if ctx.backend == "megatron" and not prefill_only:
        prefill_only = True
        req.notes.append(
            "Megatron: this plan's per-token positions (DUMP_POSITIONS=1) are recorded on the FSDP engine only, so "
            "it compares the prefill (as --prefill-only); the default plan (without --batch-one) records both sides."
        )
    skips_decode = prefill_only and "vllm-dump" in req.patch_sets
    apply(ctx, req, [ROLLOUT_PHASES] if skips_decode else [] if prefill_only else [POSITIONS])
    what = "Prefill-only consistency" if prefill_only else "Whole-response consistency"
    layers, where = _model_layers(ctx)
    prompt = ctx.int_value("data.max_prompt_length") or 512
    response = ctx.int_value("data.max_response_length") or 512
    requests = _data_parallel_size(ctx) or 1
    if layers is None:
        req.notes.append(
            f"{what}: no size estimate ({where}); each training step dumps every rollout step of its requests "
            "in statistics mode" + ("." if prefill_only else " and one per-token record per request.")
        )
        return
    tp = (world_sizes(ctx)[1] if _fsdp(ctx) else ctx.int_value(R + "tensor_model_parallel_size")) or 1
    size = whole_response(layers, prompt, 1 if skips_decode else response, requests, ctx.options.level, tp)
    if prefill_only:
        size = replace(size, records=0)
    req.notes.append(
        f"{what}: {size.describe()}, for {layers} layers ({where}), prompt {prompt} and "
        f"response {response} tokens (data.max_prompt_length / max_response_length)"
        + ("; the decode steps are not dumped (MSPROBE_ROLLOUT_PHASES=prefill)." if skips_decode else ".")
    )
    limit = ctx.options.max_dump_gib or DEFAULT_MAX_DUMP_GIB
    if size.total > limit * GIB:
        req.violations.append(
            Violation(
                "consistency.dump_size",
                "data.max_response_length",
                f"{size.total / GIB:.3g} GiB per training step",
                f"<= {limit:g} GiB",
                f"the dump would exceed --max-dump-gib {limit:g}: module rows only (--level L0, about a fourth "
                "of mix), shorter responses (data.max_response_length), or raise --max-dump-gib; --prefill-only "
                "dumps only the rollout's prefill steps",
            )
        )


# SGLang: verl's SGLang server does not read rollout.enable_prefix_caching (only vLLM's does)
SGLANG = (
    Rule(
        "consistency.sglang.radix_cache",
        R + "engine_kwargs.sglang.disable_radix_cache",
        True,
        "every dumped prefill runs the whole prompt: verl's SGLang server ignores "
        "rollout.enable_prefix_caching, and SGLang's radix cache would turn a later sample's prefill "
        "into a cache hit covering only the last tokens",
        prefix="++",
    ),
)


def sglang_pairing(ctx: Context, req: Requirements) -> None:
    """SGLang: the dispatch log names each dumped forward pass's requests (the rollout half of
    `dumps correlate`), and the radix cache off."""
    req.patch_sets.append("sglang-dispatch-log")
    apply(ctx, req, SGLANG)


def no_lora_ref_note(ctx: Context, req: Requirements) -> tuple[list[Violation], list[str]]:
    value, origin = ctx.value("actor_rollout_ref.model.lora_rank")
    if origin == "script" and value not in (None, 0, "0") and value is not MISSING:
        return [], [
            "LoRA: the ref runs on the actor engine, so ref log-prob dumps come from the actor's engine"
        ]
    return [], []

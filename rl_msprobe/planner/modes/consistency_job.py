"""Consistency at the job's own scale: the default plan of `prepare --mode consistency`.

The job keeps its train batch, mini and micro batches, `rollout.n`, `max_num_seqs`, rollout
TP / DP, dynamic batching, padding removal, batch balancing and Ulysses SP (DESIGN, "Consistency
at the job's own scale"). Only what the dump needs changes:

- eager rollout (inference's `inference.enforce_eager`), `TORCHDYNAMO_DISABLE=1`, the prefix
  cache off (vLLM `rollout.enable_prefix_caching=False`, SGLang `disable_radix_cache=True`:
  a cache hit would skip prompt rows);
- the per-token records of docs/records.md on both sides: `RL_MSPROBE_RECORD_DIR`, a share of
  the requests (`RL_MSPROBE_RECORD_SHARE`, about `--requests` a step) or exact ids
  (`RL_MSPROBE_RECORD_IDS`), `RL_MSPROBE_RECORD_LAYERS` / `_MODULES`, and the request-id chain
  of the verl-consistency set (`RL_MSPROBE_REQUEST_ID=1`);
- a bounded run: `--steps` dumped training steps, no validation, no checkpoint saving, from the
  script's model (or, with `--from-checkpoint`, from the checkpoint the script resumes);
- the actor's FSDP `param_dtype` = the rollout's dtype (both plans).

msprobe's prefill compare (PROMPTS_ONLY: every request's prefill on both sides, as statistics)
is added by `--prefill-compare` (`--prefill-only`: that compare alone, no records): the helpers
cannot cut it down to the selected requests yet, so at a production batch it is the size of the
whole batch's prefill. The records' size is said before the job runs and bounded (see
`_record_extent`). The original batch-1 / TP = device-count plan is `--batch-one` (consistency.py).
"""

from __future__ import annotations

import math
import os
import re

from rl_msprobe.planner import model_config
from rl_msprobe.planner.modes.base import ConfigSpec, Context, Requirements, Violation
from rl_msprobe.planner.modes.consistency import (
    BATCH,
    DEFAULT_MAX_DUMP_GIB,
    DTYPE,
    ENGINE_WORKERS,
    ENV,
    ROLLOUT_PHASES,
    VERSIONS,
    R,
    ascend_dispatch_note,
    backend_covered,
    heads_fit_tp,
    no_lora_ref_note,
    sglang_pairing,
)
from rl_msprobe.planner.modes.inference import rollout_requirements
from rl_msprobe.planner.modes.rules import EnvRule, From, Rule, apply, first_too_old

A = "actor_rollout_ref.actor."
DEFAULT_REQUESTS = 16  # requests recorded per dumped step unless --requests / --request
DEFAULT_BUDGET_GIB = 5.0  # the default request count shrinks to keep one dumped step's records under this
DEFAULT_STEPS = 1
_STEP_RE = re.compile(r"global_step_(\d+)")
_KEPT_ROLLOUT_RULES = ("inference.enforce_eager", "inference.vllm_runner_setting")

# the dump needs these, whatever the plan
DUMP = tuple(
    r for r in BATCH if r.rule in ("consistency.batch.enable_prefix_caching", "consistency.batch.bypass_mode")
)
TORCHDYNAMO = next(r for r in ENV if r.rule == "consistency.env.TORCHDYNAMO_DISABLE")


def dumped_steps(ctx: Context) -> int:
    """--steps N (one number: the dumped training steps); 1 by default."""
    steps = ctx.options.steps
    return steps[0] if steps else DEFAULT_STEPS


def _resumed_step(ctx: Context) -> int | None:
    """--from-checkpoint: the step of trainer.resume_from_path's global_step_K (None: not named)."""
    value, _ = ctx.value("trainer.resume_from_path")
    found = _STEP_RE.search(str(value)) if isinstance(value, str) else None
    return int(found.group(1)) if found else None


def _total_steps(ctx: Context) -> int | None:
    if not ctx.options.from_checkpoint:
        return dumped_steps(ctx)
    start = _resumed_step(ctx)
    return None if start is None else start + dumped_steps(ctx)


def _not_positive(found: object) -> bool:
    try:
        return int(str(found)) <= 0
    except ValueError:
        return False


BOUNDED = (
    Rule(
        "consistency.run.total_training_steps",
        "trainer.total_training_steps",
        From(
            _total_steps,
            "--from-checkpoint: trainer.resume_from_path names no global_step_K, so the step the run resumes "
            "from (and its end) is not known here: set trainer.resume_mode=resume_path and "
            "trainer.resume_from_path=<checkpoint folder>/global_step_K",
        ),
        lambda ctx, total: (
            f"the run ends after the {dumped_steps(ctx)} dumped step(s) (--steps)"
            + (
                f", counted from the checkpoint's step {total - dumped_steps(ctx)}"
                if ctx.options.from_checkpoint
                else ""
            )
        ),
    ),
    Rule(
        "consistency.run.test_freq",
        "trainer.test_freq",
        -1,
        "no validation: its generations would be recorded and lengthen the run",
        accept=_not_positive,
        required="-1 (or any value <= 0)",
    ),
    Rule(
        "consistency.run.val_before_train",
        "trainer.val_before_train",
        False,
        "no validation before the first step: its generations would be recorded first",
    ),
    Rule(
        "consistency.run.save_freq",
        "trainer.save_freq",
        -1,
        "no checkpoint saving: the run exists for its dumps",
        accept=_not_positive,
        required="-1 (or any value <= 0)",
    ),
    Rule(
        "consistency.run.resume_mode",
        "trainer.resume_mode",
        "disable",
        "start from the script's model: a checkpoint in trainer.default_local_dir would otherwise be resumed "
        "and the bounded run would end before its dumped steps (--from-checkpoint keeps the resume settings)",
        when=lambda ctx: not ctx.options.from_checkpoint,
    ),
)


def _megatron_tp(ctx: Context) -> int:
    return ctx.int_value(A + "megatron.tensor_model_parallel_size") or 1


MEGATRON_RECORDS = (
    # the Megatron helper records packed (THD) micro-batches per TP rank and pipeline stage; these three
    # layouts it refuses at the first micro-batch (rl_msprobe_hooks: _refuse_megatron_layouts)
    Rule(
        "consistency.records.megatron_sequence_parallel",
        A + "megatron.sequence_parallel",
        False,
        "the per-token records of the training side follow each TP rank's rows; Megatron's sequence parallelism "
        "spreads the token rows of norms and residuals over the TP ranks (verl's default with TP > 1); the "
        "same sums, gathered instead of reduce-scattered",
        when=lambda ctx: ctx.backend == "megatron" and _megatron_tp(ctx) > 1,
    ),
    Rule(
        "consistency.records.megatron_context_parallel",
        A + "megatron.context_parallel_size",
        1,
        "the per-token records follow whole sequences on each rank; context parallelism splits each sequence "
        "over ranks in chunks (--prefill-only keeps it: msprobe's prefill compare)",
        when=lambda ctx: (
            ctx.backend == "megatron" and (ctx.int_value(A + "megatron.context_parallel_size") or 1) > 1
        ),
    ),
    Rule(
        "consistency.records.megatron_remove_padding",
        A
        + "megatron.use_remove_padding",  # the Megatron engine's config (actor.use_remove_padding is FSDP's)
        True,
        "the Megatron engine's records follow its packed (THD) micro-batches, not the padded (bshd) layout",
        when=lambda ctx: (
            ctx.backend == "megatron"
            and str(ctx.value(A + "megatron.use_remove_padding")[0]).lower() == "false"
        ),
    ),
)


def _record_rules(ctx: Context, share: float | None) -> list[EnvRule]:
    """The switches of docs/records.md: where, which requests, which layers and modules."""
    options = ctx.options
    rules = [
        EnvRule(
            "consistency.env.RL_MSPROBE_REQUEST_ID",
            "RL_MSPROBE_REQUEST_ID",
            "1",
            "the verl-consistency set's request-id chain: the trainer learns each sample's rollout request id, "
            "which selects and joins the records of both sides",
        ),
        EnvRule(
            "consistency.env.RL_MSPROBE_RECORD_DIR",
            "RL_MSPROBE_RECORD_DIR",
            lambda c: os.path.join(c.dump_dir, "records"),
            "switches the per-token records on, on both sides (rollout/ and train/ below it)",
            accept=os.path.isabs,
        ),
    ]
    if options.request_ids:
        ids = ",".join(options.request_ids)
        rules.append(
            EnvRule(
                "consistency.env.RL_MSPROBE_RECORD_IDS",
                "RL_MSPROBE_RECORD_IDS",
                ids,
                f"--request: record exactly the request(s) {ids}",
            )
        )
    elif share is not None:
        rules.append(
            EnvRule(
                "consistency.env.RL_MSPROBE_RECORD_SHARE",
                "RL_MSPROBE_RECORD_SHARE",
                _share_text(share),
                "the share of requests recorded (by a hash of the request id, the same on both sides): "
                "about --requests per dumped step",
            )
        )
    if options.layers is not None:
        layers = ",".join(str(n) for n in options.layers)
        rules.append(
            EnvRule(
                "consistency.env.RL_MSPROBE_RECORD_LAYERS",
                "RL_MSPROBE_RECORD_LAYERS",
                layers,
                f"--layers: only the modules of decoder layers {layers} (and those outside every layer)",
            )
        )
    if options.modules:
        rules.append(
            EnvRule(
                "consistency.env.RL_MSPROBE_RECORD_MODULES",
                "RL_MSPROBE_RECORD_MODULES",
                options.modules,
                "--modules: only the modules whose name this regex finds",
            )
        )
    return rules


def _share_text(share: float) -> str:
    return "1" if share >= 1 else f"{share:.6g}"


def samples_per_step(ctx: Context) -> tuple[int | None, str]:
    """(the rollout requests of one training step, how it was counted or why it is not known)."""
    n = ctx.int_value(R + "n")
    if ctx.detection.fully_async:
        prompts = ctx.int_value(A + "ppo_mini_batch_size")
        batches = ctx.int_value("async_training.require_batches")
        what = "actor.ppo_mini_batch_size x async_training.require_batches x rollout.n"
        count = prompts * batches * n if prompts and batches and n else None
    else:
        prompts = ctx.int_value("data.train_batch_size")
        what = "data.train_batch_size x rollout.n"
        count = prompts * n if prompts and n else None
    if count is None:
        return None, f"{what} is only known at run time"
    return count, f"{what} = {count}"


def _records_rollout_side(ctx: Context, req: Requirements) -> None:
    """The rollout side without msprobe's dumps: eager, the engine's patch sets (vllm-dump carries
    the rollout helper on GPU vLLM), the engine named; no msprobe config."""
    scratch = Requirements()
    rollout_requirements(ctx, scratch)
    req.violations.extend(scratch.violations)
    req.patch_sets.extend(scratch.patch_sets)
    req.checks.extend(scratch.checks)
    req.removals.extend(scratch.removals)
    req.add(*(s for s in scratch.settings if s.rule in _KEPT_ROLLOUT_RULES))
    req.env.extend(e for e in scratch.env if e.rule in _KEPT_ROLLOUT_RULES)
    req.notes.extend(n for n in scratch.notes if "vllm-dump is wired into" in n)  # which runner records


def _prefill_compare(ctx: Context, req: Requirements) -> None:
    """msprobe's prefill compare (PROMPTS_ONLY), every request's prefill, as consistency always did;
    the vllm-dump helper dumps the prefill steps only."""
    rollout_requirements(ctx, req)
    every_step = "" if "vllm-dump" in req.patch_sets else " and, on this rollout, every decode step"
    req.notes.append(
        "--prefill-compare: msprobe dumps every request's prefill on both sides (statistics, every log-prob "
        f"micro-batch of the actor and every rollout prefill step{every_step}); that size is not in the records' "
        "estimate below: try it on a short run first."
    )
    req.configs.append(
        ConfigSpec(
            "actor", "config_actor.json", os.path.join(ctx.dump_dir, "actor"), None, "MSPROBE_ACTOR_CONFIG"
        )
    )
    apply(ctx, req, ENV)
    if "vllm-dump" in req.patch_sets:
        apply(ctx, req, [ROLLOUT_PHASES])
    if ctx.detection.device != "npu":
        req.notes.append(
            "The engine helper makes torch deterministic (DUMP_DETERMINISTIC=1, msprobe seed_all): a "
            "non-deterministic kernel then raises. CUBLAS_WORKSPACE_CONFIG=:4096:8 is set for cuBLAS; if another "
            "op still raises, export DUMP_DETERMINISTIC=0 (seed only)."
        )


def job_requirements(ctx: Context) -> Requirements:
    """The default consistency plan (module doc)."""
    req = Requirements()
    options = ctx.options
    msprobe = options.prefill_compare or options.prefill_only or options.zoom is not None
    if msprobe:
        _prefill_compare(ctx, req)
    else:
        _records_rollout_side(ctx, req)
    apply(ctx, req, [TORCHDYNAMO])
    no_engine = first_too_old(ctx, VERSIONS)
    if no_engine is not None:
        req.violations.append(no_engine)
    apply(ctx, req, [ENGINE_WORKERS, *DUMP])
    if not backend_covered(ctx, req):
        return req
    apply(ctx, req, [DTYPE])
    req.patch_sets.insert(0, "verl-consistency")
    if ctx.rollout == "sglang":
        sglang_pairing(ctx, req)
    ascend_dispatch_note(ctx, req)
    apply(ctx, req, BOUNDED)
    rollout_tp = ctx.int_value(R + "tensor_model_parallel_size")
    heads_fit_tp(ctx, req, rollout_tp)
    share = _record_extent(ctx, req, rollout_tp)
    if not options.prefill_only:
        apply(ctx, req, _record_rules(ctx, share))
        apply(ctx, req, MEGATRON_RECORDS)
    if ctx.backend == "megatron":
        req.notes.append(
            "Megatron: the training records come from the Megatron engine's packed (THD) micro-batches, every TP "
            "rank and pipeline stage (TP shards merge in `dumps positions`); the plan turns sequence parallelism "
            "off and keeps context parallelism at 1 for them (above); a job that needs either: --prefill-only "
            "(msprobe's prefill compare)."
        )
    if options.zoom is not None:  # msprobe mix dumps of one layer, one request, the prompt (modes/zoom.py)
        from rl_msprobe.planner.modes.zoom import apply_zoom

        apply_zoom(ctx, req, options.zoom)
    if not msprobe:
        req.notes.append(
            "msprobe's prefill compare (PROMPTS_ONLY, msprobe configs) is not in this plan: its helpers dump every "
            "request's prefill, not only the recorded ones, which at this batch is the whole batch's prefill; add "
            "--prefill-compare for it, --batch-one for the original skill's plan."
        )
    req.checks.append(no_lora_ref_note)
    return req


def _requests_of(ctx: Context) -> tuple[int, bool]:
    """(requests to record per dumped step, whether that is the default and may be fitted)."""
    options = ctx.options
    if options.request_ids:
        return len(options.request_ids), False
    if options.requests is not None:
        return options.requests, False
    return DEFAULT_REQUESTS, True


EMPTY_STEP_SAID = 0.01  # a dumped step that may record no request at all is said past this chance


def empty_step_chance(share: float, samples: int) -> float:
    """The chance that a step of SAMPLES requests records none of them when each is recorded by a
    hash of its id below SHARE (independent draws: binomial)."""
    return 0.0 if share >= 1 else (1.0 - share) ** samples


def _note_empty_steps(req: Requirements, share: float, samples: int, steps: int) -> None:
    """A share that selects about one or two requests a step leaves some steps with none (the hash
    draws each request on its own): say how likely, for a step and for the run, and what gives more."""
    step = empty_step_chance(share, samples)
    if step <= EMPTY_STEP_SAID:
        return
    run = step**steps
    req.notes.append(
        f"Records: the recorded requests are drawn by a hash of their ids, about {share * samples:.2g} a step: a "
        f"dumped step records none with a chance of {step:.0%} (the run of {steps} dumped step(s): {run:.0%}). "
        "For more: --steps N (more steps), --requests N (more a step, a larger dump), or --request ID "
        "(an exact request, e.g. triage's worst: its id is the same in a rerun)."
    )


def _record_extent(ctx: Context, req: Requirements, rollout_tp: int | None) -> float | None:
    """The records' size per dumped step and for the run, said before the job runs; the default
    request count shrinks to fit DEFAULT_BUDGET_GIB (said); past --max-dump-gib the plan is
    refused. Returns the share of requests to record (None: unknown here)."""
    from rl_msprobe.dumps.position_size import GIB, records

    options = ctx.options
    requests, fitted = _requests_of(ctx)
    samples, counted = samples_per_step(ctx)
    steps = dumped_steps(ctx)
    if samples is None and not options.request_ids:
        req.violations.append(
            Violation(
                "consistency.records.share",
                "data.train_batch_size",
                counted,
                "known when the plan is made",
                "the share of requests to record (RL_MSPROBE_RECORD_SHARE) is --requests / the requests of a step, "
                f"and {counted}: write the batch size and rollout.n into the script, or pass --request ID",
            )
        )
        return None
    value, origin = ctx.value(model_config.MODEL_KEY)
    found = model_config.read(value, origin, given=options.model_config)
    prompt = ctx.int_value("data.max_prompt_length")
    response = ctx.int_value("data.max_response_length")
    missing = [
        why
        for why, known in (
            (found.where, found.model is not None),
            ("data.max_prompt_length / max_response_length are only known at run time", prompt and response),
            (f"{R}tensor_model_parallel_size is only known at run time", rollout_tp),
        )
        if not known
    ]
    if found.model is None or not prompt or not response or not rollout_tp or missing:
        req.notes.append(
            f"Records: no size estimate ({'; '.join(missing)}); {requests} request(s) per dumped step are recorded"
            + (f" (share {_share_text(min(1.0, requests / samples))} of {counted})" if samples else "")
            + f", every position, for {steps} dumped step(s)."
        )
        if samples and not options.request_ids:
            _note_empty_steps(req, min(1.0, requests / samples), samples, steps)
        return min(1.0, requests / samples) if samples else None
    train_tp = _megatron_tp(ctx) if ctx.backend == "megatron" else 1
    tokens = prompt + response
    layers = len(options.layers) if options.layers is not None else None
    if samples is not None:
        requests = min(requests, samples)
    size = records(found.model, requests, tokens, rollout_tp, train_tp, steps, layers)
    budget = DEFAULT_BUDGET_GIB * GIB
    if fitted and size.per_step > budget:
        each = size.per_step / requests
        fit = max(1, math.floor(budget / each))
        req.notes.append(
            f"Records: {requests} request(s) per dumped step would write {size.per_step / GIB:.3g} GiB, past the default "
            f"budget of {DEFAULT_BUDGET_GIB:g} GiB: {fit} request(s) per dumped step are recorded instead "
            "(--requests N to choose)."
        )
        requests = fit
        req.decided += ["--requests", str(fit)]
        size = records(found.model, requests, tokens, rollout_tp, train_tp, steps, layers)
    share = min(1.0, requests / samples) if samples else None
    what = (
        f"the request(s) {', '.join(options.request_ids)}"
        if options.request_ids
        else f"about {requests} request(s) per dumped step (share {_share_text(share or 1.0)} of {counted})"
    )
    model = found.model
    req.notes.append(
        f"Records: {size.describe()}. Recorded: {what}, prompt {prompt} + response {response} tokens "
        f"(data.max_prompt_length / max_response_length); {model.layers} layers, {model.heads} attention heads"
        + (f", {model.experts} experts (one row per token for the experts block)" if model.experts else "")
        + f" ({found.where})."
        + (
            " --modules narrows the modules: the estimate counts every module (an upper bound)."
            if options.modules
            else ""
        )
    )
    if share is not None and not options.request_ids:
        _note_empty_steps(req, share, samples or 0, steps)
    limit = options.max_dump_gib or DEFAULT_MAX_DUMP_GIB
    if size.per_step > limit * GIB:
        req.violations.append(
            Violation(
                "consistency.dump_size",
                "data.max_response_length",
                f"{size.per_step / GIB:.3g} GiB per dumped step",
                f"<= {limit:g} GiB",
                f"the records would exceed --max-dump-gib {limit:g}: record fewer requests (--requests), fewer layers "
                "(--layers) or raise --max-dump-gib",
            )
        )
    return share

"""verl trainers: a prompts-only log-prob forward right before the old-log-prob recompute.

One marked line, ``rl_msprobe_consistency.prompts_forward(self, batch)``, in every trainer
that recomputes old log-probs: the actor runs its log-prob forward once more on a prompts-only
copy of the batch (the prefill the rollout engine ran; the one the engine hook dumps), and the
step goes on with the full batch, so the job runs to its end. The helper
(``verl/utils/rl_msprobe_consistency.py``, added by the same set) does nothing unless
``PROMPTS_ONLY=1``.

Where the line goes (verl 0.6.0 … 0.9.1), one codemod class per upstream file:

=========================================  ==========================================  ===========
trainer                                    anchor (the line goes before it)            versions
=========================================  ==========================================  ===========
``RayPPOTrainer.fit``                      ``bypass_recomputing_logprobs = ...``        0.6.1 →
(``verl/trainer/ppo/ray_trainer.py``)      ``old_log_prob = ...compute_log_prob(batch)``  0.6.0
``SeparateRayPPOTrainer                    ``bypass_recomputing_logprobs = ...``        0.7.1 →
._fit_compute_log_prob`` (separation; one-step-off and fully-async inherit it)
``PPOTrainer._compute_old_log_prob``       ``bypass_recomputing_logprobs = ...``        0.9.0 →
(``trainer/ppo/v1/trainer_base.py``, the 0.9 default; the separate-async v1 trainer delegates to it)
``PPOTrainer._compute_old_log_prob``       ``bypass_recomputing_logprobs = ...``        0.8.0
(``verl/trainer/main_ppo_sync.py``, the 0.8.0 TransferQueue trainer)
``FullyAsyncTrainer._fit_generate``        after the ``with`` block that takes the      0.8.0 →
(``fully_async_policy/fully_async_trainer.py``) batch from the queue
=========================================  ==========================================  ===========

The second ``bypass_recomputing_logprobs`` line of the separation and v1 trainers (in the
advantage step) is left alone: matching is scoped by class and method.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    MethodBlockTransformer,
    ScopedTransformer,
    TransformContext,
    call_name,
    contains_call,
    insert_after_imports,
    insert_before,
)

CONSISTENCY_IMPORT = "from verl.utils import rl_msprobe_consistency"
TRIM = "rl_msprobe_consistency.prompts_forward(self, batch)"
BYPASS = "bypass_recomputing_logprobs"


def _assigns(stmt: cst.BaseStatement, target: str) -> cst.BaseExpression | None:
    """The value of `target = value` / `target: T = value` when `stmt` is that one statement."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if (
        isinstance(small, cst.Assign)
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
        and small.targets[0].target.value == target
    ):
        return small.value
    if (
        isinstance(small, cst.AnnAssign)
        and isinstance(small.target, cst.Name)
        and small.target.value == target
    ):
        return small.value
    return None


def _is_bypass_line(stmt: cst.BaseStatement) -> bool:
    return _assigns(stmt, BYPASS) is not None


def _is_old_log_prob_recompute(stmt: cst.BaseStatement) -> bool:
    value = _assigns(stmt, "old_log_prob")
    return value is not None and call_name(value) == "self.actor_rollout_wg.compute_log_prob"


class _BeforeAnchor(MethodBlockTransformer):
    """Insert the trim line before the first statement of `method` that `matches`."""

    def __init__(self, ctx: TransformContext, method: str, anchor: str, matchers: Sequence) -> None:
        super().__init__(ctx, method)
        self.anchor, self.matchers = anchor, matchers
        self.done = False

    def rewrite(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        statements: list[cst.BaseStatement] = []
        for stmt in body:
            if not self.done and any(match(stmt) for match in self.matchers):
                self.done = True
                self.ctx.hit(self.anchor)
                statements.extend(insert_before(stmt, [self.ctx.statement(TRIM)]))
            else:
                statements.append(stmt)
        return statements


class ConsistencyCodemod(Codemod):
    """A verl file whose inserted lines call the consistency helper: run the transformer, check
    every anchor, import the helper after the file's imports."""

    project = "verl"

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        raise NotImplementedError

    def after_visit(self, transformer: cst.CSTTransformer, ctx: TransformContext) -> None:
        """Hook: anchors that depend on the version or on what the visit found."""

    def transform(self, module: cst.Module, ctx: TransformContext) -> cst.Module:
        transformer = self.transformer(ctx)
        updated = module.visit(transformer)
        self.after_visit(transformer, ctx)
        ctx.check_all_found()  # in declaration order: the method before the line inside it
        return insert_after_imports(updated, [ctx.statement(CONSISTENCY_IMPORT)])


class _TrainerCodemod(ConsistencyCodemod):
    """A trainer file: the trim line before the anchor in one method."""

    method: str
    anchor_name: str = "bypass_recomputing_logprobs line"

    def matchers(self, ctx: TransformContext) -> Sequence:
        return (_is_bypass_line,)

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _BeforeAnchor(ctx, self.method, self.anchor_name, self.matchers(ctx))


_BYPASS_EXPECTED = (
    '`bypass_recomputing_logprobs = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)`'
)


class VerlRayTrainer(_TrainerCodemod):
    name = "verl-ray-trainer"
    path = "verl/trainer/ppo/ray_trainer.py"
    method = "RayPPOTrainer.fit"
    anchor_name = "old-log-prob recompute"
    anchors = {
        "RayPPOTrainer.fit": "a method fit in class RayPPOTrainer",
        "old-log-prob recompute": f"{_BYPASS_EXPECTED} (0.6.1+) or "
        "`old_log_prob = self.actor_rollout_wg.compute_log_prob(batch)` (0.6.0) in RayPPOTrainer.fit",
    }

    def matchers(self, ctx: TransformContext) -> Sequence:
        # 0.6.1+: the bypass switch precedes the recompute; 0.6.0 has only the recompute.
        source = ctx.module.code
        if BYPASS in source:
            return (_is_bypass_line,)
        return (_is_old_log_prob_recompute,)


class VerlSeparateTrainer(_TrainerCodemod):
    name = "verl-separate-trainer"
    path = "verl/experimental/separation/ray_trainer.py"
    method = "SeparateRayPPOTrainer._fit_compute_log_prob"
    anchors = {
        "SeparateRayPPOTrainer._fit_compute_log_prob": "a method _fit_compute_log_prob in class SeparateRayPPOTrainer",
        "bypass_recomputing_logprobs line": f"{_BYPASS_EXPECTED} in SeparateRayPPOTrainer._fit_compute_log_prob",
    }


class VerlV1Trainer(_TrainerCodemod):
    name = "verl-v1-trainer"
    path = "verl/trainer/ppo/v1/trainer_base.py"
    method = "PPOTrainer._compute_old_log_prob"
    anchors = {
        "PPOTrainer._compute_old_log_prob": "a method _compute_old_log_prob in class PPOTrainer",
        "bypass_recomputing_logprobs line": f"{_BYPASS_EXPECTED} in PPOTrainer._compute_old_log_prob",
    }


class VerlSyncTrainer(_TrainerCodemod):
    name = "verl-sync-trainer"
    path = "verl/trainer/main_ppo_sync.py"
    method = "PPOTrainer._compute_old_log_prob"
    anchors = VerlV1Trainer.anchors


def _takes_from_queue(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.With) and contains_call(stmt, "self._get_samples_from_queue")


class _AfterQueue(ScopedTransformer):
    def __init__(self, ctx: TransformContext, method: str) -> None:
        super().__init__(ctx)
        self.method = method
        self.done = False

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.CSTNode:
        if qualname != self.method:
            return updated
        self.ctx.hit(self.method)
        statements: list[cst.BaseStatement] = []
        for stmt in updated.body.body:
            statements.append(stmt)
            if not self.done and _takes_from_queue(stmt):
                self.done = True
                self.ctx.hit("batch taken from the queue")
                statements.append(self.ctx.statement(TRIM))
        return updated.with_changes(body=updated.body.with_changes(body=statements))


class VerlFullyAsyncTrainer(ConsistencyCodemod):
    name = "verl-fully-async-trainer"
    path = "verl/experimental/fully_async_policy/fully_async_trainer.py"
    method = "FullyAsyncTrainer._fit_generate"
    anchors = {
        "FullyAsyncTrainer._fit_generate": "a method _fit_generate in class FullyAsyncTrainer",
        "batch taken from the queue": "a `with ...:` block calling self._get_samples_from_queue() "
        "directly in FullyAsyncTrainer._fit_generate",
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _AfterQueue(ctx, self.method)

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
``FullyAsyncTrainer.fit`` (same file)      the same ``with`` block, in the fit loop     main 2026-01
=========================================  ==========================================  ===========

Each row is a `Site` (method + statement matcher + before/after): a codemod lists its sites in
order of preference and the first whose method holds the statement is patched. A new upstream
shape is one more `Site` and one fixture pair in fixtures/codemods/<codemod>/.

The second ``bypass_recomputing_logprobs`` line of the separation and v1 trainers (in the
advantage step) is left alone: matching is scoped by class and method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import Codemod, MethodBlockTransformer, TransformContext, insert_before

CONSISTENCY_IMPORT = "from verl.utils import rl_msprobe_consistency"
TRIM = "rl_msprobe_consistency.prompts_forward(self, batch)"
BYPASS = "bypass_recomputing_logprobs"

# the statements the line is placed by
BYPASS_LINE = matchers.assigns(BYPASS)
OLD_LOG_PROB_RECOMPUTE = matchers.assigns(
    "old_log_prob", matchers.calls("self.actor_rollout_wg.compute_log_prob")
)
TAKES_FROM_QUEUE = m.With() & matchers.containing(matchers.calls("self._get_samples_from_queue"))


@dataclass(frozen=True)
class Site:
    """One upstream shape: the line goes before (or after) the first statement of `method` that
    `statement` matches. A codemod lists its sites in order of preference; the first whose method
    holds such a statement is patched (the code found decides, never the version)."""

    method: str  # Class.method
    statement: matchers.Matcher
    after: bool = False
    seen_in: str = ""  # where this shape was found upstream (information)


def choose_site(module: cst.Module, sites: tuple[Site, ...]) -> Site:
    """The first site whose method holds its statement; else the first whose method exists (its
    missing statement is then the anchor error), else the first."""
    found = [(site, matchers.method(module, site.method)) for site in sites]
    for site, func in found:
        if func is not None and m.findall(func, site.statement):
            return site
    return next((site for site, func in found if func is not None), sites[0])


class _AtSite(MethodBlockTransformer):
    """Insert the trim line by the first statement of the site's method that matches."""

    def __init__(self, ctx: TransformContext, site: Site, anchor: str) -> None:
        super().__init__(ctx, site.method)
        self.site, self.anchor = site, anchor
        self.done = False

    def rewrite(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        statements: list[cst.BaseStatement] = []
        for stmt in body:
            if self.done or not m.matches(stmt, self.site.statement):
                statements.append(stmt)
                continue
            self.done = True
            self.ctx.hit(self.anchor)
            line = self.ctx.statement(TRIM)
            statements.extend([stmt, line] if self.site.after else insert_before(stmt, [line]))
        return statements


class ConsistencyCodemod(Codemod):
    """A verl file whose inserted lines call the consistency helper (imported after its imports)."""

    project = "verl"
    helper_import = CONSISTENCY_IMPORT
    switches: ClassVar[tuple[str, ...]] = (
        "DUMP_ON",
        "PROMPTS_ONLY",
        "RL_MSPROBE_REQUEST_ID",
    )  # the request-id lines' switches


class _TrainerCodemod(ConsistencyCodemod):
    """A trainer file: the trim line at the first of its sites that the file has."""

    sites: ClassVar[tuple[Site, ...]]
    anchor_name: ClassVar[str] = "bypass_recomputing_logprobs line"
    switches = ("PROMPTS_ONLY",)

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        site = choose_site(ctx.module, self.sites)
        for other in self.sites:
            if other.method != site.method:
                ctx.waive(other.method)  # another shape's method: not required in this file
        return _AtSite(ctx, site, self.anchor_name)


_BYPASS_EXPECTED = (
    '`bypass_recomputing_logprobs = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)`'
)


class VerlRayTrainer(_TrainerCodemod):
    name = "verl-ray-trainer"
    path = "verl/trainer/ppo/ray_trainer.py"
    anchor_name = "old-log-prob recompute"
    anchors = {
        "RayPPOTrainer.fit": "a method fit in class RayPPOTrainer",
        "old-log-prob recompute": f"{_BYPASS_EXPECTED} (0.6.1+) or "
        "`old_log_prob = self.actor_rollout_wg.compute_log_prob(batch)` (0.6.0) in RayPPOTrainer.fit",
    }
    sites = (
        Site("RayPPOTrainer.fit", BYPASS_LINE, seen_in="0.6.1 …: the bypass switch precedes the recompute"),
        Site("RayPPOTrainer.fit", OLD_LOG_PROB_RECOMPUTE, seen_in="0.6.0: the recompute alone"),
    )


class VerlSeparateTrainer(_TrainerCodemod):
    name = "verl-separate-trainer"
    path = "verl/experimental/separation/ray_trainer.py"
    anchors = {
        "SeparateRayPPOTrainer._fit_compute_log_prob": "a method _fit_compute_log_prob in class SeparateRayPPOTrainer",
        "bypass_recomputing_logprobs line": f"{_BYPASS_EXPECTED} in SeparateRayPPOTrainer._fit_compute_log_prob",
    }
    sites = (Site("SeparateRayPPOTrainer._fit_compute_log_prob", BYPASS_LINE, seen_in="0.7.1 …"),)


class VerlV1Trainer(_TrainerCodemod):
    name = "verl-v1-trainer"
    path = "verl/trainer/ppo/v1/trainer_base.py"
    anchors = {
        "PPOTrainer._compute_old_log_prob": "a method _compute_old_log_prob in class PPOTrainer",
        "bypass_recomputing_logprobs line": f"{_BYPASS_EXPECTED} in PPOTrainer._compute_old_log_prob",
    }
    sites = (Site("PPOTrainer._compute_old_log_prob", BYPASS_LINE, seen_in="0.9.0 …"),)


class VerlSyncTrainer(_TrainerCodemod):
    name = "verl-sync-trainer"
    path = "verl/trainer/main_ppo_sync.py"
    anchors = VerlV1Trainer.anchors
    sites = (Site("PPOTrainer._compute_old_log_prob", BYPASS_LINE, seen_in="0.8.0"),)


class VerlFullyAsyncTrainer(_TrainerCodemod):
    name = "verl-fully-async-trainer"
    path = "verl/experimental/fully_async_policy/fully_async_trainer.py"
    anchor_name = "batch taken from the queue"
    anchors = {
        "FullyAsyncTrainer._fit_generate": "a method _fit_generate in class FullyAsyncTrainer",
        "FullyAsyncTrainer.fit": "a method fit in class FullyAsyncTrainer",
        "batch taken from the queue": "a `with ...:` block calling self._get_samples_from_queue() "
        "in FullyAsyncTrainer._fit_generate (or, before it existed, FullyAsyncTrainer.fit)",
    }
    sites = (
        Site("FullyAsyncTrainer._fit_generate", TAKES_FROM_QUEUE, after=True, seen_in="0.8.0 …"),
        Site(
            "FullyAsyncTrainer.fit",
            TAKES_FROM_QUEUE,
            after=True,
            seen_in="verl main 2026-01-06 … 2026-02-05 (#4795 … #5184): the fit loop takes the batch itself",
        ),
    )

"""verl trainers: one triage line after each place verl measures rollout vs training log-probs.

verl computes ``training/rollout_probs_diff_*`` (with ``rollout.calculate_log_probs=True``) in
one statement, ``metrics.update(calculate_debug_metrics(<batch>))``, right after the
old-log-prob recompute. The marked line goes after that statement and hands the same batch to
the helper the set adds (``verl/utils/rl_msprobe_triage.py``), imported on the spot so no
module-level line is shared with another set's import::

    metrics.update(calculate_debug_metrics(batch))
    from verl.utils import rl_msprobe_triage
    rl_msprobe_triage.log_requests(batch, self)                     # DataProto trainers
    rl_msprobe_triage.log_requests(data, self, batch)               # TransferQueue trainers

So the per-request lines are exactly what verl's metric averaged. Shape, not version: each
codemod patches every such statement in its file, whichever method holds it; when the
statement's argument is not the enclosing method's ``batch`` parameter (the TransferQueue
trainers measure a padded copy, ``data``, of a ``KVBatchMeta`` ``batch``), ``batch`` is passed
too, so the helper can read the prompts and ids from TransferQueue. A file with no such
statement fails loudly.

Files, one codemod class each (the statement was found in every release 0.7.0 … 0.9.1):
``verl/trainer/ppo/ray_trainer.py`` (``RayPPOTrainer.fit``), ``verl/experimental/separation/
ray_trainer.py`` (``SeparateRayPPOTrainer._fit_compute_log_prob``; one-step-off and fully-async
inherit it), ``verl/trainer/main_ppo_sync.py`` and ``verl/trainer/ppo/v1/trainer_base.py``
(``PPOTrainer._compute_old_log_prob``).
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import Codemod, TransformContext

TRIAGE_IMPORT = "from verl.utils import rl_msprobe_triage"
ANCHOR = "calculate_debug_metrics call"
_EXPECTED = "`metrics.update(calculate_debug_metrics(<batch>))` (verl's rollout-vs-actor log-prob metrics)"


# `<metrics>.update(calculate_debug_metrics(NAME))`, alone on its line: NAME is the batch measured
MEASURES = matchers.one_line(
    m.Expr(
        value=m.Call(
            func=m.Attribute(value=matchers.DOTTED, attr=m.Name("update")),
            args=[
                m.Arg(
                    value=m.Call(
                        func=m.Name("calculate_debug_metrics"), args=[m.Arg(value=matchers.saves(m.Name()))]
                    )
                )
            ],
        )
    )
)


def measured_batch(stmt: cst.BaseStatement) -> str | None:
    """`metrics.update(calculate_debug_metrics(NAME))` -> NAME, else None."""
    return matchers.saved_name(stmt, MEASURES)


class _AfterMetrics(cst.CSTTransformer):
    """Adds the triage line after every measuring statement, knowing the enclosing method's params."""

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.params: list[list[str]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.params.append([p.name.value for p in node.params.params])
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.BaseStatement:
        self.params.pop()
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        return updated.with_changes(body=self._rewrite(updated.body))

    def _rewrite(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for stmt in body:
            out.append(stmt)
            measured = measured_batch(stmt)
            if measured is not None:
                self.ctx.hit(ANCHOR)
                out.extend(self.ctx.statements(f"{TRIAGE_IMPORT}\n{self.call(measured)}"))
        return out

    def call(self, measured: str) -> str:
        params = self.params[-1] if self.params else []
        owner = "self" if params[:1] == ["self"] else "None"
        source = ", batch" if measured != "batch" and "batch" in params else ""
        return f"rl_msprobe_triage.log_requests({measured}, {owner}{source})"


class _TriageCodemod(Codemod):
    project = "verl"
    anchors = {ANCHOR: _EXPECTED}

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _AfterMetrics(ctx)


class VerlTriageRayTrainer(_TriageCodemod):
    name = "verl-triage-ray-trainer"
    path = "verl/trainer/ppo/ray_trainer.py"


class VerlTriageSeparateTrainer(_TriageCodemod):
    name = "verl-triage-separate-trainer"
    path = "verl/experimental/separation/ray_trainer.py"


class VerlTriageSyncTrainer(_TriageCodemod):
    name = "verl-triage-sync-trainer"
    path = "verl/trainer/main_ppo_sync.py"


class VerlTriageV1Trainer(_TriageCodemod):
    name = "verl-triage-v1-trainer"
    path = "verl/trainer/ppo/v1/trainer_base.py"

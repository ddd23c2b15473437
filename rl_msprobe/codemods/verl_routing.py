"""verl MoE routing records on both sides (`verl/utils/rl_msprobe_routing.py`, the verl-routing set).

- Trainer (`verl/workers/engine_workers.py`, class `ActorRolloutRefWorker`): around every
  assignment `X = self.actor.infer_batch(DATA)` (the actor's old-log-prob recompute,
  `compute_log_prob`)::

      _rl_msprobe_routing = rl_msprobe_routing.begin(self, DATA)
      X = self.actor.infer_batch(DATA)
      rl_msprobe_routing.end(_rl_msprobe_routing)

  The reference model's `self.ref.infer_batch` is left alone (no routing of the reference).
- Rollout (`verl/workers/rollout/vllm_rollout/utils.py`, class `vLLMColocateWorkerExtension`): the
  first statement of `update_weights_from_ipc` is `rl_msprobe_routing.rollout(self)`: the vLLM
  worker's model gets its gate hooks at the first weight sync (before any rollout), once.

Shape decides: the classes present without these statements are an error naming what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    after_docstring,
    body_of,
    insert_before,
    with_body,
)

HELPER_IMPORT = "from verl.utils import rl_msprobe_routing"
ACTOR = "ActorRolloutRefWorker"
INFER = "self.actor.infer_batch"
EXTENSION = "vLLMColocateWorkerExtension"
SYNC = f"{EXTENSION}.update_weights_from_ipc"
TOKEN = "_rl_msprobe_routing"

# `X = self.actor.infer_batch(DATA)` / `(data=DATA)`, alone on its line
RECOMPUTE = matchers.one_line(m.Assign(value=matchers.calls(INFER)))


def recompute_data(stmt: cst.BaseStatement) -> str | None:
    """The source of DATA in `X = self.actor.infer_batch(DATA)`, else None."""
    if not m.matches(stmt, RECOMPUTE):
        return None
    assert isinstance(stmt, cst.SimpleStatementLine)
    small = stmt.body[0]
    assert isinstance(small, cst.Assign) and isinstance(small.value, cst.Call)
    args = small.value.args
    if not args:
        return "None"
    named = [a for a in args if a.keyword is not None and a.keyword.value == "data"]
    arg = named[0] if named else args[0]
    return cst.Module([]).code_for_node(arg.value)


class _TrainerTransformer(ScopedTransformer):
    targets = (ACTOR,)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value == ACTOR:
            self.ctx.hit(f"class {ACTOR}")
        return super().visit_ClassDef(node)

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if not self.qualname.startswith(f"{ACTOR}."):
            return updated
        body: list[cst.BaseStatement] = []
        for stmt in updated.body:
            data = recompute_data(stmt)
            if data is None:
                body.append(stmt)
                continue
            self.ctx.hit("infer_batch assignment")
            begin = self.ctx.statement(f"{TOKEN} = rl_msprobe_routing.begin(self, {data})")
            body += [*insert_before(stmt, [begin]), self.ctx.statement(f"rl_msprobe_routing.end({TOKEN})")]
        return updated.with_changes(body=tuple(body))


class VerlRoutingTrainer(Codemod):
    name = "verl-routing-trainer"
    project = "verl"
    path = "verl/workers/engine_workers.py"
    subject = (ACTOR,)
    anchors = {
        f"class {ACTOR}": f"a top-level class {ACTOR}",
        "infer_batch assignment": (
            f"an assignment `X = {INFER}(data)` in a method of {ACTOR} (the actor's log-prob recompute)"
        ),
    }
    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _TrainerTransformer(ctx)


class _RolloutTransformer(ScopedTransformer):
    targets = (SYNC,)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value == EXTENSION:
            self.ctx.hit(f"class {EXTENSION}")
        return super().visit_ClassDef(node)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname != SYNC:
            return updated
        self.ctx.hit(SYNC)
        body: Sequence[cst.BaseStatement] = body_of(updated)
        at = after_docstring(body)
        line = self.ctx.statement("rl_msprobe_routing.rollout(self)")
        return with_body(updated, [*body[:at], *insert_before(body[at], [line]), *body[at + 1 :]])


class VerlRoutingRollout(Codemod):
    name = "verl-routing-rollout"
    project = "verl"
    path = "verl/workers/rollout/vllm_rollout/utils.py"
    subject = (EXTENSION,)
    anchors = {
        f"class {EXTENSION}": f"a top-level class {EXTENSION}",
        SYNC: f"a method update_weights_from_ipc in class {EXTENSION} (the vLLM worker's weight sync)",
    }
    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _RolloutTransformer(ctx)

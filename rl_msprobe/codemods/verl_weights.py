"""verl weight sync: fingerprint lines on both sides (`verl/utils/rl_msprobe_weights.py`, same set).

- Actor side (`verl/workers/engine_workers.py`, class `ActorRolloutRefWorker`): after every
  assignment `X, ... = self.actor.engine.get_per_tensor_param(...)` in any of its methods (the
  colocated and checkpoint-engine paths of `update_weights`, 0.7.1+; `wake_up`, 0.7.0):
  `X = rl_msprobe_weights.sent(X, global_steps)` — the generator is wrapped, not consumed
  (`None` for the step where the method has no `global_steps` parameter).
- Rollout side (`verl/workers/rollout/vllm_rollout/utils.py`, class `vLLMColocateWorkerExtension`):
  `@rl_msprobe_weights.engine_sync` on `update_weights_from_ipc` (one sync per call; the resident
  fingerprints are written when it returns) and `rl_msprobe_weights.received(self, WEIGHTS)` as
  the first statement of `_update_weights` (WEIGHTS: its first parameter after self), before the
  model's `load_weights`.

Shape decides: a class present without its anchors is an error naming what was expected.
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
from rl_msprobe.codemods.vllm_model_runner import marked_decorator

HELPER_IMPORT = "from verl.utils import rl_msprobe_weights"
ACTOR = "ActorRolloutRefWorker"
GET_PARAMS = "self.actor.engine.get_per_tensor_param"
EXTENSION = "vLLMColocateWorkerExtension"


def _params(function: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in (*function.params.posonly_params, *function.params.params)]


# `X, ... = self.actor.engine.get_per_tensor_param(...)` or `X = ...`: X is the weight stream
STREAM = matchers.one_line(
    m.Assign(targets=[m.AssignTarget(target=matchers.saves())], value=matchers.calls(GET_PARAMS))
)


def _stream_name(stmt: cst.BaseStatement) -> str | None:
    """`X, ... = self.actor.engine.get_per_tensor_param(...)` (or `X = ...`): X, else None."""
    return matchers.saved_name(stmt, STREAM)


class _SentTransformer(ScopedTransformer):
    targets = (ACTOR,)

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        self.steps: list[str] = []  # the step expression of each enclosing method

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value == ACTOR:
            self.ctx.hit(f"class {ACTOR}")
        return super().visit_ClassDef(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.steps.append("global_steps" if "global_steps" in _params(node) else "None")
        return super().visit_FunctionDef(node)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        self.steps.pop()
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if not self.steps or not self.qualname.startswith(f"{ACTOR}."):
            return updated
        body: list[cst.BaseStatement] = []
        for stmt in updated.body:
            body.append(stmt)
            name = _stream_name(stmt)
            if name is not None:
                self.ctx.hit("get_per_tensor_param assignment")
                body.append(self.ctx.statement(f"{name} = rl_msprobe_weights.sent({name}, {self.steps[-1]})"))
        return updated.with_changes(body=tuple(body))


class VerlWeightsSent(Codemod):
    name = "verl-weights-sent"
    project = "verl"
    path = "verl/workers/engine_workers.py"
    subject = (ACTOR,)
    anchors = {
        f"class {ACTOR}": f"a top-level class {ACTOR}",
        "get_per_tensor_param assignment": (
            f"an assignment `X, ... = {GET_PARAMS}(...)` in a method of {ACTOR} (the weight sync's source)"
        ),
    }

    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _SentTransformer(ctx)


class _ReceivedTransformer(ScopedTransformer):
    targets = (f"{EXTENSION}.update_weights_from_ipc", f"{EXTENSION}._update_weights")

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value == EXTENSION:
            self.ctx.hit(f"class {EXTENSION}")
        return super().visit_ClassDef(node)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname == f"{EXTENSION}.update_weights_from_ipc":
            self.ctx.hit(qualname)
            decorator = marked_decorator(self.ctx, "rl_msprobe_weights.engine_sync")
            return updated.with_changes(decorators=[decorator, *updated.decorators])
        if qualname == f"{EXTENSION}._update_weights":
            params = _params(updated)
            if len(params) < 2:
                self.ctx.fail(qualname)
            self.ctx.hit(qualname)
            body: Sequence[cst.BaseStatement] = body_of(updated)
            at = after_docstring(body)
            line = self.ctx.statement(f"rl_msprobe_weights.received(self, {params[1]})")
            return with_body(updated, [*body[:at], *insert_before(body[at], [line]), *body[at + 1 :]])
        return updated


class VerlWeightsReceived(Codemod):
    name = "verl-weights-received"
    project = "verl"
    path = "verl/workers/rollout/vllm_rollout/utils.py"
    subject = (EXTENSION,)
    anchors = {
        f"class {EXTENSION}": f"a top-level class {EXTENSION}",
        f"{EXTENSION}.update_weights_from_ipc": f"a method update_weights_from_ipc in class {EXTENSION}",
        f"{EXTENSION}._update_weights": f"a method _update_weights(self, weights, ...) in class {EXTENSION}",
    }

    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _ReceivedTransformer(ctx)

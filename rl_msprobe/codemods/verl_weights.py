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

- Bucket (`verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py`): in every method of
  `BucketedWeightSender`, after each `META[NAME] = {...}` (a tensor's bucket metadata),
  `rl_msprobe_weights.tag(META[NAME], NAME)` adds the sender's {hash, fp} of that tensor; in
  `BucketedWeightReceiver.receive_weights`, after `X = self.socket.recv_pyobj()`,
  `rl_msprobe_weights.arrived(X, settles=True)` keeps them for the received line, and after the
  call of its callback parameter (`on_bucket_received(...)`: the bucket loaded, its buffer not yet
  reused) `rl_msprobe_weights.settled()` writes the received records the resident checks of that
  bucket did not settle: a TP-1 tensor is checksummed once, where the engine holds it, if it can be.
  A loop reading buckets (`X = self.socket.recv_pyobj()`) in another method of the receiver (upstream
  a32d635's generator `iter_weights`, reverted a week later) has no site for the received line: refused.

Shape decides: a class present without its anchors is an error naming what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

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
SENDER = "BucketedWeightSender"
RECEIVER = "BucketedWeightReceiver"


def _params(function: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in (*function.params.posonly_params, *function.params.params)]


def _lines_after(
    ctx: TransformContext, block: cst.IndentedBlock, lines_for: Callable[[cst.BaseStatement], list[str]]
) -> cst.IndentedBlock:
    """BLOCK with the lines LINES_FOR gives for a statement inserted right after it."""
    body: list[cst.BaseStatement] = []
    for stmt in block.body:
        body += [stmt, *(ctx.statement(line) for line in lines_for(stmt))]
    return block.with_changes(body=tuple(body))


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
        return _lines_after(self.ctx, updated, self._lines)

    def _lines(self, stmt: cst.BaseStatement) -> list[str]:
        name = _stream_name(stmt)
        if name is None:
            return []
        self.ctx.hit("get_per_tensor_param assignment")
        return [f"{name} = rl_msprobe_weights.sent({name}, {self.steps[-1]})"]


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


# `META[NAME] = {...}`: one tensor's entry in the bucket's metadata (META and NAME plain names)
BUCKET_ENTRY = matchers.one_line(
    m.Assign(
        targets=[
            m.AssignTarget(
                target=m.Subscript(value=m.Name(), slice=[m.SubscriptElement(slice=m.Index(value=m.Name()))])
            )
        ],
        value=m.Dict(),
    )
)
# `X = self.socket.recv_pyobj()`: a bucket's metadata arriving
ARRIVAL = matchers.one_line(
    m.Assign(
        targets=[m.AssignTarget(target=matchers.saves(m.Name()))],
        value=matchers.calls("self.socket.recv_pyobj"),
    )
)


def _entry(stmt: cst.BaseStatement) -> tuple[str, str] | None:
    """(META, NAME) of `META[NAME] = {...}`, else None."""
    if not m.matches(stmt, BUCKET_ENTRY):
        return None
    assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
    target = cst.ensure_type(assign.targets[0].target, cst.Subscript)
    index = cst.ensure_type(target.slice[0].slice, cst.Index)
    return cst.ensure_type(target.value, cst.Name).value, cst.ensure_type(index.value, cst.Name).value


RECEIVE_LOOPS = "bucket receive loops"
NodeT = TypeVar("NodeT", bound=cst.CSTNode)


class _BucketTransformer(ScopedTransformer):
    targets = (SENDER, RECEIVER)

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        self.callback: str | None = None  # receive_weights' first parameter after self
        self.loops = 0  # the `for` / `while` loops the walk is inside

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.loops += isinstance(node, (cst.For, cst.While))
        return super().on_visit(node)

    def on_leave(
        self, original_node: NodeT, updated_node: NodeT
    ) -> NodeT | cst.RemovalSentinel | cst.FlattenSentinel[NodeT]:
        self.loops -= isinstance(original_node, (cst.For, cst.While))
        return super().on_leave(original_node, updated_node)

    def leave_scope(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.BaseStatement:
        if not self.scope and original.name.value == RECEIVER:
            self.ctx.hit(RECEIVE_LOOPS)  # walked whole: no other method receives buckets
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node.name.value == "receive_weights":
            params = _params(node)
            self.callback = params[1] if len(params) > 1 else None
        return super().visit_FunctionDef(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value in (SENDER, RECEIVER):
            self.ctx.hit(f"class {node.name.value}")
        return super().visit_ClassDef(node)

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        sending = self.qualname.startswith(f"{SENDER}.")
        receiving = self.qualname.startswith(f"{RECEIVER}.receive_weights")
        if not (sending or receiving):
            elsewhere = self.loops and self.qualname.startswith(f"{RECEIVER}.")
            if elsewhere and any(matchers.saved_name(stmt, ARRIVAL) for stmt in updated.body):
                self.ctx.fail(RECEIVE_LOOPS)  # buckets whose weights no received line would record
            return updated
        return _lines_after(self.ctx, updated, self._sender_lines if sending else self._receiver_lines)

    def _sender_lines(self, stmt: cst.BaseStatement) -> list[str]:
        entry = _entry(stmt)
        if entry is None:
            return []
        self.ctx.hit("bucket metadata entry")
        return [f"rl_msprobe_weights.tag({entry[0]}[{entry[1]}], {entry[1]})"]

    def _receiver_lines(self, stmt: cst.BaseStatement) -> list[str]:
        if self.callback and m.matches(stmt, matchers.one_line(m.Expr(m.Call(func=m.Name(self.callback))))):
            self.ctx.hit("bucket callback")
            return ["rl_msprobe_weights.settled()"]
        arrival = matchers.saved_name(stmt, ARRIVAL)
        if arrival is None:
            return []
        self.ctx.hit("bucket metadata arrival")
        return [f"rl_msprobe_weights.arrived({arrival}, settles=True)"]


class VerlWeightsBucket(Codemod):
    name = "verl-weights-bucket"
    project = "verl"
    path = "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
    subject = (SENDER, RECEIVER)
    anchors = {
        f"class {SENDER}": f"a top-level class {SENDER}",
        "bucket metadata entry": f"an assignment `META[NAME] = {{...}}` in a method of {SENDER} (a tensor's entry)",
        f"class {RECEIVER}": f"a top-level class {RECEIVER}",
        "bucket metadata arrival": (
            f"an assignment `X = self.socket.recv_pyobj()` in {RECEIVER}.receive_weights (a bucket's metadata)"
        ),
        "bucket callback": (
            f"a call `CALLBACK(...)` alone on its line in {RECEIVER}.receive_weights(self, CALLBACK, ...)"
            " (a bucket loaded)"
        ),
        RECEIVE_LOOPS: (
            f"every loop of {RECEIVER} that reads a bucket's metadata (`X = self.socket.recv_pyobj()`)"
            " in receive_weights; another method receiving buckets (such as a generator iter_weights)"
            " would load weights that no received line records"
        ),
    }

    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _BucketTransformer(ctx)

"""verl FSDP engine: one msprobe step per micro-batch in `FSDPEngine.forward_backward_batch`.

Before the `with` block that runs `self.forward_step(...)` (and the backward, when not
forward-only) the helper starts the debugger on `self.module`; after it, the helper logs the
micro-batch's request ids and calls `stop()` + `step()`. Decisions (DUMP_ON, DUMP_PHASE, ref
engine) live in `verl/utils/rl_msprobe_hooks.py`, added by the same patch set.

Drift handled (verl 0.6.0 … 0.9.1): `for micro_batch in micro_batches:` vs
`for micro_batch_idx, micro_batch in enumerate(micro_batches):`; `with ctx:` vs
`with ctx, sync_ctx[, record_function(...)]:`; every backward form (inside the with block).
"""

from __future__ import annotations

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    body_of,
    contains_call,
    dotted,
    insert_before,
    with_body,
)

HOOKS_IMPORT = "from verl.utils import rl_msprobe_hooks"


class _Transformer(ScopedTransformer):
    targets = ("FSDPEngine.forward_backward_batch",)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname != "FSDPEngine.forward_backward_batch":
            return updated
        self.ctx.hit("FSDPEngine.forward_backward_batch")
        body = []
        for stmt in body_of(updated):
            if isinstance(stmt, cst.For) and _iterates_micro_batches(stmt):
                self.ctx.hit("micro-batch loop")
                stmt = self._wrap_forward(stmt)
            body.append(stmt)
        return with_body(updated, body)

    def _wrap_forward(self, loop: cst.For) -> cst.For:
        statements: list[cst.BaseStatement] = []
        for stmt in body_of(loop):
            if isinstance(stmt, cst.With) and contains_call(stmt, "self.forward_step"):
                self.ctx.hit("with-block around self.forward_step")
                start = self.ctx.statement(
                    "_rl_msprobe_mb = rl_msprobe_hooks.micro_batch_start(self, micro_batch, forward_only)"
                )
                statements.extend(insert_before(stmt, [start]))
                statements.append(self.ctx.statement("rl_msprobe_hooks.micro_batch_end(_rl_msprobe_mb)"))
            else:
                statements.append(stmt)
        return with_body(loop, statements)


def _iterates_micro_batches(loop: cst.For) -> bool:
    names = {dotted(n) for n in _names(loop.target)}
    return "micro_batch" in names and "micro_batches" in {dotted(n) for n in _names(loop.iter)}


def _names(node: cst.CSTNode) -> list[cst.Name]:
    found: list[cst.Name] = []

    class _Collect(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name)

    node.visit(_Collect())
    return found


class VerlFSDPEngine(Codemod):
    name = "verl-fsdp-engine"
    project = "verl"
    path = "verl/workers/engine/fsdp/transformer_impl.py"
    anchors = {
        "FSDPEngine.forward_backward_batch": "a method forward_backward_batch in class FSDPEngine",
        "micro-batch loop": "a loop `for micro_batch in micro_batches:` (or over enumerate(micro_batches))",
        "with-block around self.forward_step": "a `with ctx...:` block in the loop that calls self.forward_step(...)",
    }

    helper_import = HOOKS_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

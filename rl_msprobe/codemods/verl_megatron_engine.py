"""verl Megatron engine: one msprobe step per micro-batch forward.

Megatron's schedule owns the micro-batch loop, so the decision (DUMP_ON, DUMP_PHASE, ref
engine) is taken once per batch at the top of `MegatronEngine.forward_backward_batch`, and
every `output = forward_fn(...)` / `output = fused_forward_fn(...)` in
`MegatronEngineWithLMHead.forward_step` is wrapped in start / stop + step on the model chunk
being run. The value-head engine's own `forward_fn` call is left alone (scoped by class).

Drift handled (verl 0.6.0 … main): one `forward_fn(` call (≤ 0.7.0, and early-2026 main) or two
under `if use_fused_kernels:` / `else:` (0.7.1+); the one-line and the multi-line `forward_step`
signature (`logits_processor_func` from 0.8.0). Which calls are required follows from the code:
the fused call is required only where `forward_step` calls `fused_forward_fn` at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    after_docstring,
    body_of,
    contains_call,
    insert_before,
    with_body,
)
from rl_msprobe.codemods.verl_fsdp_engine import HOOKS_IMPORT

FORWARD_CALLS = {"forward_fn", "fused_forward_fn"}


def _forward_callee(stmt: cst.BaseStatement) -> str | None:
    """The forward function `stmt` keeps the result of (`output = forward_fn(...)` alone on its
    line), else None. Plain node checks: verl-engine then never imports `libcst.matchers` (0.6 s)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or not isinstance(assign.value, cst.Call):
        return None
    func = assign.value.func
    return func.value if isinstance(func, cst.Name) and func.value in FORWARD_CALLS else None


class _Transformer(ScopedTransformer):
    targets = ("MegatronEngine.forward_backward_batch", "MegatronEngineWithLMHead.forward_step")

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if not self.qualname.startswith("MegatronEngineWithLMHead.forward_step"):
            return updated
        statements: list[cst.BaseStatement] = []
        for stmt in updated.body:
            callee = _forward_callee(stmt)
            if callee is not None:
                self.ctx.hit(f"{callee} call")
                start = self.ctx.statement("rl_msprobe_hooks.megatron_forward_start(self, model, batch)")
                statements.extend(insert_before(stmt, [start]))
                statements.append(self.ctx.statement("rl_msprobe_hooks.megatron_forward_end(self, batch)"))
            else:
                statements.append(stmt)
        return updated.with_changes(body=statements)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname == "MegatronEngineWithLMHead.forward_step":
            self.ctx.hit("MegatronEngineWithLMHead.forward_step")
            if not _has_param(updated, "batch_iter"):
                self.ctx.fail("MegatronEngineWithLMHead.forward_step")
            if not contains_call(original, "fused_forward_fn"):  # this code has no fused path
                self.ctx.waive("fused_forward_fn call")
        if qualname != "MegatronEngine.forward_backward_batch":
            return updated
        self.ctx.hit("MegatronEngine.forward_backward_batch")
        body: Sequence[cst.BaseStatement] = body_of(updated)
        at = after_docstring(body)
        decide = self.ctx.statement("rl_msprobe_hooks.megatron_batch_begin(self, forward_only)")
        return with_body(updated, [*body[:at], decide, *body[at:]])


def _has_param(func: cst.FunctionDef, name: str) -> bool:
    return any(p.name.value == name for p in func.params.params)


class VerlMegatronEngine(Codemod):
    name = "verl-megatron-engine"
    project = "verl"
    path = "verl/workers/engine/megatron/transformer_impl.py"
    anchors = {
        "MegatronEngine.forward_backward_batch": "a method forward_backward_batch in class MegatronEngine",
        "MegatronEngineWithLMHead.forward_step": "a method forward_step(self, batch_iter, model, ...) "
        "in class MegatronEngineWithLMHead",
        "forward_fn call": "`output = forward_fn(...)` in MegatronEngineWithLMHead.forward_step",
        "fused_forward_fn call": "`output = fused_forward_fn(...)` in MegatronEngineWithLMHead.forward_step "
        "(required where forward_step calls fused_forward_fn, as verl 0.7.1 and later do)",
    }

    helper_import = HOOKS_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

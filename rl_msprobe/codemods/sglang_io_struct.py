"""SGLang io_struct: an optional fixed bootstrap room (PD disaggregation + data parallelism).

In `sglang/srt/managers/io_struct.py`, the first statement of
`GenerateReqInput._normalize_bootstrap_params` (after its docstring) becomes
`rl_msprobe_bootstrap_room.pin(self)`: with `MSPROBE_BOOTSTRAP_ROOM=N` a batch without a room
gets room N, which SGLang normalises to N, N+1, … — the DP controller's `room % dp_size`
routing is then the same on every run. The method exists from SGLang 0.5.2 on.
"""

from __future__ import annotations

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    after_docstring,
    body_of,
    with_body,
)

IMPORT = "from sglang.srt.managers import rl_msprobe_bootstrap_room"
METHOD = "GenerateReqInput._normalize_bootstrap_params"


class _Transformer(ScopedTransformer):
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        super().visit_ClassDef(node)
        return self.qualname == "GenerateReqInput"  # nothing else is walked

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        return False

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname != METHOD:
            return updated
        self.ctx.hit(METHOD)
        body = list(body_of(updated))
        at = after_docstring(body)
        return with_body(
            updated, [*body[:at], self.ctx.statement("rl_msprobe_bootstrap_room.pin(self)"), *body[at:]]
        )


class SGLangIoStruct(Codemod):
    name = "sglang-io-struct"
    project = "sglang"
    path = "sglang/srt/managers/io_struct.py"
    anchors = {METHOD: "a method _normalize_bootstrap_params in class GenerateReqInput (SGLang 0.5.2+)"}

    helper_import = IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

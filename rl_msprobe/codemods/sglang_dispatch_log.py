"""SGLang ModelRunner: log which requests each dumped forward pass served (consistency pairing).

In `sglang/srt/model_executor/model_runner.py`, class `ModelRunner`, method `forward(self,
forward_batch, ...)`: `rl_msprobe_dispatch.log_forward(self, forward_batch)` as the first
statement (after a docstring). It runs before the msprobe debugger starts (SGLang's own from
0.5.11, or the sglang-dump patch's below), so msprobe's step counter still names the step this
pass is dumped as, and it does not depend on where either debugger's lines are. The logic lives
in `sglang/srt/model_executor/rl_msprobe_dispatch.py`, added by the same patch set.

The line imports the helper itself (`from ... import rl_msprobe_dispatch; rl_msprobe_dispatch
.log_forward(...)`, one marked line; a cached import per forward pass) rather than at the top of
the file: with the sglang-dump patch on the same file, two helper imports after the last import
would stand in the order the sets were applied, and each set's status would then depend on it.
"""

from __future__ import annotations

import libcst as cst

from rl_msprobe.codemods.base import Codemod, ScopedTransformer, TransformContext, body_of, with_body

IMPORT = "from sglang.srt.model_executor import rl_msprobe_dispatch"
BATCH = "forward_batch"


def _has_param(func: cst.FunctionDef, name: str) -> bool:
    params = func.params
    return any(p.name.value == name for p in (*params.posonly_params, *params.params, *params.kwonly_params))


class _Transformer(ScopedTransformer):
    targets = ("ModelRunner.forward",)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        return False  # forward is edited whole in leave_function

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname != "ModelRunner.forward" or len(self.scope) != 1:
            return updated
        if not _has_param(updated, BATCH):
            self.ctx.fail("forward(self, forward_batch)")
        self.ctx.hit("forward(self, forward_batch)")
        body = list(body_of(updated))
        at = 0 if updated.get_docstring(clean=False) is None else 1
        line = self.ctx.statement(f"{IMPORT}; rl_msprobe_dispatch.log_forward(self, {BATCH})")
        return with_body(updated, [*body[:at], line, *body[at:]])


class SGLangDispatchLog(Codemod):
    name = "sglang-dispatch-log"
    project = "sglang"
    path = "sglang/srt/model_executor/model_runner.py"
    anchors = {
        "forward(self, forward_batch)": "method ModelRunner.forward with a `forward_batch` parameter",
    }
    subject = ("ModelRunner",)

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

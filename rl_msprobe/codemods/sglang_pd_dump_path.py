"""SGLang ModelRunner (native msprobe, 0.5.11+): a dump folder per PD role.

verl hands one `engine_kwargs.sglang` to every SGLang server of a PD replica, so the prefill and
the decode servers get the same `msprobe_dump_config` and both write `step{N}/rank0` under one
dump_path (each is TP rank 0 of its own server). In `sglang/srt/model_executor/model_runner.py`,
class `ModelRunner`: right after the statement that creates SGLang's own debugger
(`self.msprobe_debugger = <call>`, in `init_msprobe`), `rl_msprobe_pd.role_dump_path(self)`
moves that debugger's dump_path to `{dump_path}/prefill` or `{dump_path}/decode` by
`server_args.disaggregation_mode` (unchanged without PD). The line imports the helper itself
(one marked line, as in sglang-dispatch-log). The logic lives in
`sglang/srt/model_executor/rl_msprobe_pd.py`, added by the same patch set.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import Codemod, ScopedTransformer, TransformContext, body_of, with_body

IMPORT = "from sglang.srt.model_executor import rl_msprobe_pd"
CREATES = matchers.assigns("self.msprobe_debugger", m.Call())


class _Transformer(ScopedTransformer):
    targets = ("ModelRunner",)  # its methods' bodies; the rest of the file is not walked

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if not qualname.startswith("ModelRunner.") or qualname.count(".") != 1:
            return updated
        body: list[cst.BaseStatement] = []
        for stmt in body_of(updated):
            body.append(stmt)
            if m.matches(stmt, CREATES):
                if "self.msprobe_debugger = <call>" in self.ctx.found:  # a second one: which is it?
                    self.ctx.fail("self.msprobe_debugger = <call>")
                self.ctx.hit("self.msprobe_debugger = <call>")
                body.append(self.ctx.statement(f"{IMPORT}; rl_msprobe_pd.role_dump_path(self)"))
        return with_body(updated, body)


class SGLangPdDumpPath(Codemod):
    name = "sglang-pd-dump-path"
    project = "sglang"
    path = "sglang/srt/model_executor/model_runner.py"
    anchors = {
        "self.msprobe_debugger = <call>": "exactly one statement in ModelRunner's methods that creates "
        "SGLang's own msprobe debugger, `self.msprobe_debugger = <call>` (init_msprobe; SGLang 0.5.11 and later)",
    }
    subject = ("ModelRunner",)

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

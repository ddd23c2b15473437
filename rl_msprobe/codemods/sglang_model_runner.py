"""SGLang ModelRunner: one msprobe step per forward pass (SGLang below 0.5.11).

In `sglang/srt/model_executor/model_runner.py`, class `ModelRunner`:

- `__init__`: after `self.forward_pass_id = 0`, `rl_msprobe_dump.create(self)` — the debugger
  from `MSPROBE_ROLLOUT_CONFIG` (PD disaggregation: `MSPROBE_PREFILL_CONFIG` /
  `MSPROBE_DECODE_CONFIG` by `server_args.disaggregation_mode`), or nothing when unset;
- `forward`: `rl_msprobe_dump.start(self)` right after `self.forward_pass_id += 1`
  (`rank_id=self.gpu_id` when data parallel size > 1), and `rl_msprobe_dump.finish(self)`
  (stop + step) just before `return output`.

Drift handled (0.4.6.post5 … 0.5.10.post1, DOMAIN §4): the `__init__` parameter lists of
0.4.6 / 0.4.10 (moe_ep) / 0.5.1 (dp_rank) / 0.5.10 (attn_cp_rank, memory_pool_config); the
first "Parse args" assignment (`self.model_config` in 0.4.6.post5, `self.mem_fraction_static`
after); `forward`'s `with ...:` vs `with ... as recorder_outputs:` and the later statements
before `return output` (elastic EP, experts capturer, dumper). The logic lives in
`sglang/srt/model_executor/rl_msprobe_dump.py`, added by the same patch set.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    body_of,
    insert_before,
    with_body,
)

IMPORT = "from sglang.srt.model_executor import rl_msprobe_dump"


COUNTER = "self.forward_pass_id"
COUNTER_INIT = matchers.one_line(
    m.Assign(targets=[m.AssignTarget(target=matchers.name(COUNTER))], value=m.Integer())
)
COUNTER_STEP = matchers.one_line(m.AugAssign(target=matchers.name(COUNTER), operator=m.AddAssign()))
RETURN_OUTPUT = matchers.one_line(m.Return(value=m.Name("output")))


def _is_counter_init(stmt: cst.BaseStatement) -> bool:
    return m.matches(stmt, COUNTER_INIT)


def _is_counter_step(stmt: cst.BaseStatement) -> bool:
    return m.matches(stmt, COUNTER_STEP)


def _is_return_output(stmt: cst.BaseStatement) -> bool:
    return m.matches(stmt, RETURN_OUTPUT)


def _count_returns(node: cst.CSTNode) -> int:
    """`return` statements in a function body, nested functions and classes excluded."""
    count = 0

    class _Returns(cst.CSTVisitor):
        def visit_Return(self, _: cst.Return) -> None:
            nonlocal count
            count += 1

        def visit_FunctionDef(self, _: cst.FunctionDef) -> bool:
            return False

        def visit_Lambda(self, _: cst.Lambda) -> bool:
            return False

        def visit_ClassDef(self, _: cst.ClassDef) -> bool:
            return False

    node.visit(_Returns())
    return count


class _Transformer(ScopedTransformer):
    # Only ModelRunner.__init__ and ModelRunner.forward are walked: the rest of the file (3,000
    # lines and more) is left unvisited, which keeps a run well under a second.
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        super().visit_ClassDef(node)
        return self.qualname == "ModelRunner"

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        return False  # the methods are edited whole in leave_function

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname == "ModelRunner.__init__":
            return self._init(updated)
        if qualname == "ModelRunner.forward":
            return self._forward(updated)
        return updated

    def _init(self, func: cst.FunctionDef) -> cst.FunctionDef:
        body: list[cst.BaseStatement] = []
        for stmt in body_of(func):
            body.append(stmt)
            if _is_counter_init(stmt) and "__init__: self.forward_pass_id = 0" not in self.ctx.found:
                self.ctx.hit("__init__: self.forward_pass_id = 0")
                body.append(self.ctx.statement("rl_msprobe_dump.create(self)"))
        return with_body(func, body)

    def _forward(self, func: cst.FunctionDef) -> cst.FunctionDef:
        statements = list(body_of(func))
        returns = [i for i, stmt in enumerate(statements) if _is_return_output(stmt)]
        counters = [i for i, stmt in enumerate(statements) if _is_counter_step(stmt)]
        if len(returns) != 1 or _count_returns(func.body) != 1:  # a second way out would skip stop + step
            self.ctx.fail("forward: return output")
        if not counters or counters[0] > returns[0]:
            self.ctx.fail("forward: self.forward_pass_id += 1")
        self.ctx.hit("forward: return output")
        self.ctx.hit("forward: self.forward_pass_id += 1")
        (at_return,), at_counter = returns, counters[0]
        body: list[cst.BaseStatement] = []
        for index, stmt in enumerate(statements):
            if index == at_return:
                body.extend(insert_before(stmt, [self.ctx.statement("rl_msprobe_dump.finish(self)")]))
                continue
            body.append(stmt)
            if index == at_counter:
                body.append(self.ctx.statement("rl_msprobe_dump.start(self)"))
        return with_body(func, body)


class SGLangModelRunner(Codemod):
    name = "sglang-model-runner"
    project = "sglang"
    path = "sglang/srt/model_executor/model_runner.py"
    anchors = {
        "__init__: self.forward_pass_id = 0": "`self.forward_pass_id = 0` in the body of ModelRunner.__init__",
        "forward: self.forward_pass_id += 1": "`self.forward_pass_id += 1` in the body of ModelRunner.forward, "
        "before its return",
        "forward: return output": "exactly one return in ModelRunner.forward: `return output` at the end of its body",
    }

    helper_import = IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

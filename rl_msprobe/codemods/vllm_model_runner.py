"""Upstream vLLM V1 model runner: one msprobe step per model step in `GPUModelRunner.execute_model`.

Four kinds of marked lines in `vllm/v1/worker/gpu_model_runner.py`, all calling
`vllm/v1/worker/rl_msprobe_dump.py` (added by the same set):

- after the imports: `from vllm.v1.worker import rl_msprobe_dump`;
- last line of `GPUModelRunner.__init__`: `rl_msprobe_dump.init_runner(self)` — with
  MSPROBE_ROLLOUT_CONFIG set, refuses a non-eager engine and reads the config, before any
  request is served;
- a decorator line on `execute_model`, outermost: `@rl_msprobe_dump.dump_step`. Only whole
  lines may be inserted, so no `try/finally` can be put *inside* the method; a decorator gives
  the same guarantee from outside: its `finally` stops and steps the debugger on every way out
  of `execute_model` — the five or so `return`s (no work, encoder-only, pipeline-parallel
  intermediate tensors, pooling, the normal `return None`) and exceptions — without anchoring
  on any of them, so new early returns in later releases are covered too;
- just before the statement that calls `self._model_forward(...)`:
  `rl_msprobe_dump.start_forward(self)`, so the dump window is the model forward plus the
  logits, not the input preparation.

The CPU runner subclasses `GPUModelRunner` without overriding `execute_model`, so it runs this
code. Drift handled (vLLM 0.24.0 … 0.33.0, all twelve releases checked): `__init__` gains a
`@JitWarmupRegistry.capture` decorator in 0.30.0 (irrelevant to the last-line insertion); the
forward is `model_output = self._model_forward(...)` inside a multi-context `with` throughout.
vLLM 0.34.0 removed this file (only the V2 runner is left): the piece is not applicable there and
the V2 runner's own codemod (`vllm_model_runner_v2.py`, the same lines) is the dump path.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    body_of,
    contains_call,
    insert_before,
    with_body,
)

HELPER_IMPORT = "from vllm.v1.worker import rl_msprobe_dump"
CLASS = "GPUModelRunner"
FORWARD_CALL = "self._model_forward"
FORWARD_ANCHOR = "model forward in execute_model"
BLOCKS = (cst.With, cst.If, cst.For, cst.While, cst.Try, cst.TryStar)
BATCH_LOCAL = "input_batch"
BATCH_ANCHOR = "input_batch local in execute_model"
SAMPLE_ANCHOR = f"{CLASS}.sample_tokens"


def marked_decorator(ctx: TransformContext, expression: str) -> cst.Decorator:
    """`@expression  # rl-msprobe:<name>` as a decorator node (a whole marked line)."""
    newline = ctx.module.default_newline
    code = f"@{expression}  {ctx.codemod.marker}{newline}def _f():{newline}    pass{newline}"
    func = cst.parse_module(code, config=ctx.module.config_for_parsing).body[0]
    assert isinstance(func, cst.FunctionDef)
    return func.decorators[0]


class RunnerTransformer(ScopedTransformer):
    """The three insertions in a top-level `GPUModelRunner` (V1 and V2 alike): the init check last
    in `__init__`, the step decorator outermost on `execute_model`, the start before each statement
    of `execute_model` that calls `forward_call` (anchor `forward_anchor`)."""

    targets = (f"{CLASS}.__init__", f"{CLASS}.execute_model", f"{CLASS}.sample_tokens")

    def __init__(
        self,
        ctx: TransformContext,
        forward_call: str,
        forward_anchor: str,
        start_args: str = "self",
        batch_anchor: str | None = None,
        sample_anchor: str | None = None,
    ) -> None:
        super().__init__(ctx)
        self.forward_call = forward_call
        self.forward_anchor = forward_anchor
        self.start_args = start_args
        self.batch_anchor = batch_anchor
        self.sample_anchor = sample_anchor

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope and node.name.value == CLASS:
            self.ctx.hit(f"class {CLASS}")
        return super().visit_ClassDef(node)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname == f"{CLASS}.__init__":
            self.ctx.hit(f"{CLASS}.__init__")
            body = list(body_of(updated))
            return with_body(updated, [*body, self.ctx.statement("rl_msprobe_dump.init_runner(self)")])
        if qualname == f"{CLASS}.execute_model":
            self.ctx.hit(f"{CLASS}.execute_model")
            if self.batch_anchor is not None and assigns_name(original, BATCH_LOCAL):
                self.ctx.hit(self.batch_anchor)
            start = _ForwardStart(self.ctx, self.forward_call, self.forward_anchor, self.start_args)
            updated = updated.with_changes(body=start.visit_block(updated.body))
            decorator = marked_decorator(self.ctx, "rl_msprobe_dump.dump_step")
            return updated.with_changes(decorators=[decorator, *updated.decorators])
        if qualname == f"{CLASS}.sample_tokens" and self.sample_anchor is not None:
            self.ctx.hit(self.sample_anchor)
            decorator = marked_decorator(self.ctx, "rl_msprobe_dump.sample_step")
            return updated.with_changes(decorators=[decorator, *updated.decorators])
        return updated


def assigns_name(function: cst.FunctionDef, name: str) -> bool:
    """Does FUNCTION's own body (any block, not nested functions) assign the local NAME (`NAME = ...`)?"""

    class _Finder(cst.CSTVisitor):
        found = False

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is function

        def visit_ClassDef(self, node: cst.ClassDef) -> bool:
            return False

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            if isinstance(node.target, cst.Name) and node.target.value == name:
                self.found = True

    finder = _Finder()
    function.visit(finder)
    return finder.found


class _ForwardStart:
    """Insert the start line before every simple statement (in any block) that calls the forward."""

    def __init__(
        self,
        ctx: TransformContext,
        call: str = FORWARD_CALL,
        anchor: str = FORWARD_ANCHOR,
        args: str = "self",
    ) -> None:
        self.ctx = ctx
        self.call = call
        self.anchor = anchor
        self.args = args

    def visit_block(self, block: cst.BaseSuite) -> cst.BaseSuite:
        if not isinstance(block, cst.IndentedBlock):
            return block
        statements: list[cst.BaseStatement] = []
        for stmt in block.body:
            if isinstance(stmt, cst.SimpleStatementLine) and contains_call(stmt, self.call):
                self.ctx.hit(self.anchor)
                statements.extend(
                    insert_before(stmt, [self.ctx.statement(f"rl_msprobe_dump.start_forward({self.args})")])
                )
            elif isinstance(stmt, BLOCKS):  # not into nested functions, classes or `match` cases
                statements.append(self._compound(stmt))
            else:
                statements.append(stmt)
        return block.with_changes(body=tuple(statements))

    def _compound(self, stmt: cst.BaseCompoundStatement) -> cst.BaseCompoundStatement:
        changes: dict[str, object] = {"body": self.visit_block(stmt.body)}
        orelse = getattr(stmt, "orelse", None)
        if isinstance(orelse, cst.If):
            changes["orelse"] = self._compound(orelse)
        elif isinstance(orelse, cst.Else):
            changes["orelse"] = orelse.with_changes(body=self.visit_block(orelse.body))
        if isinstance(stmt, cst.Try):
            changes["handlers"] = [h.with_changes(body=self.visit_block(h.body)) for h in stmt.handlers]
            if stmt.finalbody is not None:
                changes["finalbody"] = stmt.finalbody.with_changes(body=self.visit_block(stmt.finalbody.body))
        return stmt.with_changes(**changes)


class RunnerCodemod(Codemod):
    """A vLLM model runner file (V1 or V2): the same lines, its own forward statement. A subclass
    names the forward call and its anchor; the anchors follow from them."""

    project = "vllm"
    subject = (CLASS,)
    helper_import = HELPER_IMPORT
    forward_call: ClassVar[str]
    forward_anchor: ClassVar[str]
    # the V2 runner keeps its step's batch in a local (`input_batch`) that the start line passes on,
    # and computes the logits in `sample_tokens` (decorated too); the V1 runner does neither
    passes_batch: ClassVar[bool] = False
    decorates_sampling: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.anchors = {
            f"class {CLASS}": f"a top-level class {CLASS} in {cls.path}",
            f"{CLASS}.__init__": f"a method __init__ in class {CLASS}",
            f"{CLASS}.execute_model": f"a method execute_model in class {CLASS}",
            cls.forward_anchor: f"a statement in {CLASS}.execute_model calling {cls.forward_call}(...)",
        }
        if cls.passes_batch:
            cls.anchors[BATCH_ANCHOR] = (
                f"a local `{BATCH_LOCAL} = ...` in {CLASS}.execute_model (the step's batch)"
            )
        if cls.decorates_sampling:
            cls.anchors[SAMPLE_ANCHOR] = f"a method sample_tokens in class {CLASS} (the step's logits)"

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return RunnerTransformer(
            ctx,
            self.forward_call,
            self.forward_anchor,
            start_args=f"self, {BATCH_LOCAL}" if self.passes_batch else "self",
            batch_anchor=BATCH_ANCHOR if self.passes_batch else None,
            sample_anchor=SAMPLE_ANCHOR if self.decorates_sampling else None,
        )


class VllmModelRunner(RunnerCodemod):
    name = "vllm-model-runner"
    path = "vllm/v1/worker/gpu_model_runner.py"
    forward_call = FORWARD_CALL
    forward_anchor = FORWARD_ANCHOR

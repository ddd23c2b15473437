"""verl rollout clients: the request id a rollout server received, kept in the output.

The consistency join (DOMAIN §6) links a rollout dispatch to a training micro-batch by
request id. The id is made inside the client's ``server.generate.remote(request_id=...)``
call (``uuid4().hex`` from 0.7.0, ``self._vllm_request_id(request_id)`` from 0.9.0), so the
existing line cannot name it; instead two marked lines surround that call::

    server = rl_msprobe_consistency.record_request_id(server)          # sees the id the server gets
    output = await server.generate.remote(request_id=..., ...)
    rl_msprobe_consistency.keep_request_id(output, server)             # output.extra_fields["request_id"]

Both are no-ops unless ``DUMP_ON``, ``PROMPTS_ONLY`` or ``RL_MSPROBE_REQUEST_ID`` is 1.
verl then carries ``extra_fields`` into ``DataProto.non_tensor_batch["request_id"]``.

Drift handled, one codemod class per upstream file:

- ``verl/experimental/agent_loop/agent_loop.py`` (0.6.0 – 0.7.1): ``AsyncLLMServerManager.generate``.
  Before 0.7.1 the server's ``TokenOutput`` has no ``extra_fields`` and the agent loops build
  their output without them, so ``AgentLoopWorker._run_agent_loop`` also gets two lines
  (``begin_request()`` before ``agent_loop.run(...)``, ``attach_request_id(output)`` after):
  the id travels in a context variable of the sample's asyncio task. The same two lines are
  inserted in 0.7.1 too (harmless there: the id is already in ``extra_fields``).
- ``verl/workers/rollout/llm_server.py`` (0.8.0 →): ``LLMServerClient.generate``; where the
  file also holds a fully-async subclass of ``LLMServerClient`` (``FullyAsyncLLMServerClient``
  from 0.9.0, ``FullyLLMServerClient`` on main in spring 2026), its resume loop rebuilds the
  output: after each ``output = await super().generate(...)`` the parent's ``extra_fields`` are
  kept (first attempt wins, so the id is the prompt's prefill).
- ``verl/experimental/fully_async_policy/fully_async_rollouter.py`` (0.8.0): the same fix where
  that file defines the ``LLMServerClient`` subclass.

Which file applies is decided by the code found (the class each codemod patches), not by the
version: a checkout between two releases gets whichever client it really has.
- ``verl/trainer/ppo/v1/agent_loop_tq.py`` (0.9.0 →, the v1 trainer): samples go to
  TransferQueue as dicts whose ``extra_fields`` is one field; one line after
  ``field["position_ids"] = position_ids`` also stores ``field["request_id"]`` so the engine
  micro-batch has a top-level ``request_id`` as on the DataProto path. (0.8.0's
  ``main_ppo_sync.py`` keeps it inside ``extra_fields`` only: read it there.)
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import (
    MethodBlockTransformer,
    ScopedTransformer,
    TransformContext,
    insert_before,
    top_level_classes,
)
from rl_msprobe.codemods.verl_trainer import ConsistencyCodemod

RECORD = "server = rl_msprobe_consistency.record_request_id(server)"
KEEP = "rl_msprobe_consistency.keep_request_id(output, server)"
BEGIN = "rl_msprobe_consistency.begin_request()"
ATTACH = "rl_msprobe_consistency.attach_request_id(output)"
KEEP_PARENT = "rl_msprobe_consistency.keep_parent_extra_fields(final_output, output)"


@dataclass(frozen=True)
class Surround:
    """Marked lines around one awaited call: in `method` of each class it names, the statement
    `target = await call(...)` gets `before` above it and `after` below it.

    Which classes hold the method is the one place upstream drift shows: `classes` lists the
    names it has had (the method moved between them), `subclasses_of` takes every top-level
    subclass of a class whatever its name (the fully-async client was renamed), and `optional`
    says the file may have no such class at all (then its anchors are waived)."""

    method_anchor: str
    call_anchor: str
    method: str
    call: str  # dotted, `super().generate` for the parent's method
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    target: str = "output"
    classes: tuple[str, ...] = ()
    subclasses_of: str | None = None
    optional: bool = False

    @property
    def statement(self) -> matchers.Matcher:
        return matchers.assigns(self.target, matchers.awaits(self.call))

    def holds(self, node: cst.ClassDef) -> bool:
        """Whether this top-level class is one of those that hold the method."""
        return node.name.value in self.classes or (
            self.subclasses_of is not None and self.subclasses_of in _base_names(node)
        )


def _base_names(node: cst.ClassDef) -> list[str]:
    out = []
    for base in node.bases:
        if isinstance(base.value, cst.Name):
            out.append(base.value.value)
        elif isinstance(base.value, cst.Attribute):
            out.append(base.value.attr.value)
    return out


class _Surround(ScopedTransformer):
    """Applies a codemod's `Surround`s: the first that holds a top-level class patches its method."""

    def __init__(self, ctx: TransformContext, surrounds: Sequence[Surround]) -> None:
        super().__init__(ctx)
        self.surrounds = surrounds
        self.rules: dict[str, Surround] = {}  # Class.method -> its Surround
        self.seen: set[Surround] = set()  # the surrounds some class of this file holds

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope:
            for surround in self.surrounds:
                if surround.holds(node):
                    self.rules.setdefault(f"{node.name.value}.{surround.method}", surround)
                    self.seen.add(surround)
        return super().visit_ClassDef(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        if self.qualname in self.rules:
            self.ctx.hit(self.rules[self.qualname].method_anchor)
        return True

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        rule = self.rules.get(self.qualname)
        if rule is None:
            return updated
        statements: list[cst.BaseStatement] = []
        call = rule.statement
        for stmt in updated.body:
            if m.matches(stmt, call):
                self.ctx.hit(rule.call_anchor)
                statements.extend(insert_before(stmt, [self.ctx.statement(line) for line in rule.before]))
                statements.extend(self.ctx.statement(line) for line in rule.after)
            else:
                statements.append(stmt)
        return updated.with_changes(body=statements)


class _RequestIdCodemod(ConsistencyCodemod):
    """A rollout-client file: the request-id lines around the calls its `surrounds` name."""

    surrounds: ClassVar[tuple[Surround, ...]]

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Surround(ctx, self.surrounds)

    def after_visit(self, transformer: cst.CSTTransformer, ctx: TransformContext) -> None:
        assert isinstance(transformer, _Surround)
        for surround in self.surrounds:
            if surround.optional and surround not in transformer.seen:
                ctx.waive(surround.method_anchor)
                ctx.waive(surround.call_anchor)


_SERVER_CALL = "`output = await server.generate.remote(request_id=..., ...)` (or `output: TokenOutput = ...`)"
_FULLY_ASYNC_EXPECTED = "a method generate in a subclass of LLMServerClient (the fully-async client)"
_SUPER_CALL_EXPECTED = "`output = await super().generate(...)` in the fully-async client's generate"
# the fully-async client resumes an aborted request: keep the first attempt's extra_fields
FULLY_ASYNC_CLIENT = Surround(
    "fully-async client generate",
    "super().generate call",
    "generate",
    "super().generate",
    after=(KEEP_PARENT,),
    subclasses_of="LLMServerClient",
)


class VerlAgentLoopRequestId(_RequestIdCodemod):
    name = "verl-agent-loop-request-id"
    path = "verl/experimental/agent_loop/agent_loop.py"
    subject = ("AsyncLLMServerManager",)  # from 0.8.0 the client lives in llm_server.py instead
    anchors = {
        "AsyncLLMServerManager.generate": "a method generate in class AsyncLLMServerManager",
        "server.generate.remote call": f"{_SERVER_CALL} in AsyncLLMServerManager.generate",
        "AgentLoopWorker._run_agent_loop": "a method _run_agent_loop in class AgentLoopWorker "
        "(AgentLoopWorkerBase in 0.6.1 - 0.7.0)",
        "agent_loop.run call": "`output: AgentLoopOutput = await agent_loop.run(...)` in "
        "AgentLoopWorker._run_agent_loop",
    }
    surrounds = (
        Surround(
            "AsyncLLMServerManager.generate",
            "server.generate.remote call",
            "generate",
            "server.generate.remote",
            before=(RECORD,),
            after=(KEEP,),
            classes=("AsyncLLMServerManager",),
        ),
        Surround(
            "AgentLoopWorker._run_agent_loop",
            "agent_loop.run call",
            "_run_agent_loop",
            "agent_loop.run",
            before=(BEGIN,),
            after=(ATTACH,),
            classes=("AgentLoopWorker", "AgentLoopWorkerBase"),  # 0.6.1 - 0.7.0: on AgentLoopWorkerBase
        ),
    )


class VerlLLMServerRequestId(_RequestIdCodemod):
    name = "verl-llm-server-request-id"
    path = "verl/workers/rollout/llm_server.py"
    subject = ("LLMServerClient",)
    anchors = {
        "LLMServerClient.generate": "a method generate in class LLMServerClient",
        "server.generate.remote call": f"{_SERVER_CALL} in LLMServerClient.generate",
        "fully-async client generate": f"{_FULLY_ASYNC_EXPECTED}, where this file defines one",
        "super().generate call": _SUPER_CALL_EXPECTED,
    }
    surrounds = (
        Surround(
            "LLMServerClient.generate",
            "server.generate.remote call",
            "generate",
            "server.generate.remote",
            before=(RECORD,),
            after=(KEEP,),
            classes=("LLMServerClient",),
        ),
        # 0.8.0 defines the fully-async client in fully_async_rollouter.py, not here
        dataclasses.replace(FULLY_ASYNC_CLIENT, optional=True),
    )


class VerlFullyAsyncRolloutRequestId(_RequestIdCodemod):
    name = "verl-fully-async-rollouter-request-id"
    path = "verl/experimental/fully_async_policy/fully_async_rollouter.py"
    anchors = {
        "fully-async client generate": _FULLY_ASYNC_EXPECTED,
        "super().generate call": _SUPER_CALL_EXPECTED,
    }
    surrounds = (FULLY_ASYNC_CLIENT,)

    def present(self, source: str) -> bool:
        """Only where this file defines the client (verl 0.8.0); later it lives in llm_server.py."""
        return any(
            isinstance(base, ast.Name) and base.id == "LLMServerClient"
            for node in top_level_classes(source).values()
            for base in node.bases
        )

    def subject_text(self) -> str:
        return "subclass of LLMServerClient"


LIFT = "rl_msprobe_consistency.lift_request_id(field)"
POSITION_FIELD = 'field["position_ids"] = position_ids'


class _AfterPositionField(MethodBlockTransformer):
    def rewrite(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        statements: list[cst.BaseStatement] = []
        for stmt in body:
            statements.append(stmt)
            if isinstance(stmt, cst.SimpleStatementLine) and _code(stmt) == POSITION_FIELD:
                self.ctx.hit("position_ids field")
                statements.append(self.ctx.statement(LIFT))
        return statements


def _code(stmt: cst.SimpleStatementLine) -> str:
    return cst.Module(body=[]).code_for_node(stmt.with_changes(leading_lines=())).strip()


class VerlAgentLoopTQRequestId(ConsistencyCodemod):
    name = "verl-agent-loop-tq-request-id"
    path = "verl/trainer/ppo/v1/agent_loop_tq.py"
    method = "AgentLoopWorkerTQ._agent_loop_postprocess"
    anchors = {
        "AgentLoopWorkerTQ._agent_loop_postprocess": "a method _agent_loop_postprocess in class AgentLoopWorkerTQ",
        "position_ids field": f"`{POSITION_FIELD}` in AgentLoopWorkerTQ._agent_loop_postprocess",
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _AfterPositionField(ctx, self.method)

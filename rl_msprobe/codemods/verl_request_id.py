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
from collections.abc import Sequence

import libcst as cst

from rl_msprobe.codemods.base import (
    MethodBlockTransformer,
    ScopedTransformer,
    TransformContext,
    call_name,
    insert_before,
    top_level_classes,
)
from rl_msprobe.codemods.verl_trainer import ConsistencyCodemod

RECORD = "server = rl_msprobe_consistency.record_request_id(server)"
KEEP = "rl_msprobe_consistency.keep_request_id(output, server)"
BEGIN = "rl_msprobe_consistency.begin_request()"
ATTACH = "rl_msprobe_consistency.attach_request_id(output)"
KEEP_PARENT = "rl_msprobe_consistency.keep_parent_extra_fields(final_output, output)"


def _awaited_call(stmt: cst.BaseStatement, target: str) -> str | None:
    """`target = await f(...)` / `target: T = await f(...)`: the dotted name of f, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        name, value = small.targets[0].target, small.value
    elif isinstance(small, cst.AnnAssign):
        name, value = small.target, small.value
    else:
        return None
    if not (isinstance(name, cst.Name) and name.value == target and isinstance(value, cst.Await)):
        return None
    if isinstance(value.expression, cst.Call) and isinstance(value.expression.func, cst.Attribute):
        func = value.expression.func
        if isinstance(func.value, cst.Call) and call_name(func.value) == "super":
            return f"super().{func.attr.value}"
    return call_name(value.expression)


class _Surround(ScopedTransformer):
    """In each method of `rules`, put lines before / after the statement that matches.

    rules: {qualname: (method anchor, statement anchor, target variable, awaited call, lines before,
    lines after)}; several qualnames may share a method anchor (a method that moved between classes).
    """

    def __init__(
        self,
        ctx: TransformContext,
        rules: dict[str, tuple[str, str, str, str, tuple, tuple]],
        subclass_rules: dict[str, tuple[str, tuple[str, str, str, str, tuple, tuple]]] | None = None,
    ) -> None:
        super().__init__(ctx)
        self.rules = dict(rules)
        # {base class: (method, rule)}: the rule also holds for `Sub.method` of every subclass found
        self.subclass_rules = subclass_rules or {}
        self.subclasses: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if not self.scope:
            for base in node.bases:
                name = base.value.attr.value if isinstance(base.value, cst.Attribute) else None
                name = base.value.value if isinstance(base.value, cst.Name) else name
                if name in self.subclass_rules:
                    method, rule = self.subclass_rules[name]
                    self.rules.setdefault(f"{node.name.value}.{method}", rule)
                    self.subclasses.append(node.name.value)
        return super().visit_ClassDef(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        if self.qualname in self.rules:
            self.ctx.hit(self.rules[self.qualname][0])
        return True

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.CSTNode:
        rule = self.rules.get(self.qualname)
        if rule is None:
            return updated
        _, anchor, target, call, before, after = rule
        statements: list[cst.BaseStatement] = []
        for stmt in updated.body:
            if _awaited_call(stmt, target) == call:
                self.ctx.hit(anchor)
                statements.extend(insert_before(stmt, [self.ctx.statement(line) for line in before]))
                statements.extend(self.ctx.statement(line) for line in after)
            else:
                statements.append(stmt)
        return updated.with_changes(body=statements)


_FULLY_ASYNC_RULE = (
    "fully-async client generate",
    "super().generate call",
    "output",
    "super().generate",
    (),
    (KEEP_PARENT,),
)
_SUBCLASS_RULES = {"LLMServerClient": ("generate", _FULLY_ASYNC_RULE)}
_FULLY_ASYNC_EXPECTED = "a method generate in a subclass of LLMServerClient (the fully-async client)"
_SUPER_CALL_EXPECTED = "`output = await super().generate(...)` in the fully-async client's generate"
_SERVER_CALL = "`output = await server.generate.remote(request_id=..., ...)` (or `output: TokenOutput = ...`)"


class VerlAgentLoopRequestId(ConsistencyCodemod):
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

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        rules = {
            "AsyncLLMServerManager.generate": (
                "AsyncLLMServerManager.generate",
                "server.generate.remote call",
                "output",
                "server.generate.remote",
                (RECORD,),
                (KEEP,),
            ),
        }
        # 0.6.1 - 0.7.0 define _run_agent_loop on AgentLoopWorkerBase, the others on AgentLoopWorker.
        for owner in ("AgentLoopWorker", "AgentLoopWorkerBase"):
            rules[f"{owner}._run_agent_loop"] = (
                "AgentLoopWorker._run_agent_loop",
                "agent_loop.run call",
                "output",
                "agent_loop.run",
                (BEGIN,),
                (ATTACH,),
            )
        return _Surround(ctx, rules)


class VerlLLMServerRequestId(ConsistencyCodemod):
    name = "verl-llm-server-request-id"
    path = "verl/workers/rollout/llm_server.py"
    subject = ("LLMServerClient",)
    anchors = {
        "LLMServerClient.generate": "a method generate in class LLMServerClient",
        "server.generate.remote call": f"{_SERVER_CALL} in LLMServerClient.generate",
        "fully-async client generate": f"{_FULLY_ASYNC_EXPECTED}, where this file defines one",
        "super().generate call": _SUPER_CALL_EXPECTED,
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        rules = {
            "LLMServerClient.generate": (
                "LLMServerClient.generate",
                "server.generate.remote call",
                "output",
                "server.generate.remote",
                (RECORD,),
                (KEEP,),
            ),
        }
        return _Surround(ctx, rules, _SUBCLASS_RULES)

    def after_visit(self, transformer: cst.CSTTransformer, ctx: TransformContext) -> None:
        if not transformer.subclasses:  # 0.8.0 defines the fully-async client in fully_async_rollouter.py
            ctx.waive("fully-async client generate")
            ctx.waive("super().generate call")


class VerlFullyAsyncRolloutRequestId(ConsistencyCodemod):
    name = "verl-fully-async-rollouter-request-id"
    path = "verl/experimental/fully_async_policy/fully_async_rollouter.py"
    anchors = {
        "fully-async client generate": _FULLY_ASYNC_EXPECTED,
        "super().generate call": _SUPER_CALL_EXPECTED,
    }

    def present(self, source: str) -> bool:
        """Only where this file defines the client (verl 0.8.0); later it lives in llm_server.py."""
        return any(
            isinstance(base, ast.Name) and base.id == "LLMServerClient"
            for node in top_level_classes(source).values()
            for base in node.bases
        )

    def subject_text(self) -> str:
        return "subclass of LLMServerClient"

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Surround(ctx, {}, _SUBCLASS_RULES)


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

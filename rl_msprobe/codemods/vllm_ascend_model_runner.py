"""vLLM-Ascend model runner: a dispatch log line for every dumped model step, dumps under `{pid}`.

vLLM-Ascend dumps the rollout itself (`additional_config.dump_config_path`) but does not say
which requests each `step{N}` served. This codemod adds, in `NPUModelRunner`
(`vllm_ascend/worker/model_runner_v1.py`):

- after each `self.debugger = <PrecisionDebugger | AclGraphDumper>(...)` in `__init__`:
  `dispatch_logger.attach(self)` (dump path moved to a `{pid}` sub-folder, logger created);
- before each point where a step's dump is finished, in `execute_model` and `sample_tokens`:
  `dispatch_logger.log_step(self, scheduler_output)`;
- per-token records (RL_MSPROBE_RECORD_DIR, with or without the dump): before the model forward
  in `execute_model` (`hidden_states = self._model_forward(...)`, 0.18 on;
  `self._generate_process_reqs_hidden_states(...)` before), `dispatch_logger.start_records(self,
  scheduler_output)`, and the outermost decorator `@dispatch_logger.record_step` on
  `execute_model`, which writes the record (hooks removed) on every way out. vLLM-Ascend computes
  the logits in `execute_model` (V1 runner), so the record holds them.

Drift handled (vLLM-Ascend 0.12.0rc1 … 0.30.0rc2, DOMAIN §5):
- 0.12.0rc1: debugger under `if self.dump_enable:`; four `self.debugger.stop()` in
  `if need_dump:` blocks (two in execute_model, two in sample_tokens);
- 0.13.0rc1 – 0.14.0rc1: `if dump_cfg is not None:` + eager check; four `stop()` under
  `if self.debugger is not None:`;
- 0.15.0rc1 – 0.19.1rc1: three `stop()` (two in execute_model, one in sample_tokens);
- 0.20.2rc1 →: `PrecisionDebugger` or `AclGraphDumper` (two assignments under if / else);
  the step ends in `self._finalize_dump_data()` (three in execute_model, one in
  sample_tokens; the `dump=False` call of the dummy run is not a dumped step and is left alone).
The logic lives in `vllm_ascend/worker/dispatch_logger.py`, added by the same patch set.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    call_name,
    contains_call,
    insert_before,
)
from rl_msprobe.codemods.vllm_model_runner import marked_decorator

CLASS = "NPUModelRunner"
IMPORT = "from vllm_ascend.worker import dispatch_logger"
ATTACH = "dispatch_logger.attach(self)"
LOG = "dispatch_logger.log_step(self, scheduler_output)"
FINISH_CALLS = ("self.debugger.stop", "self._finalize_dump_data")
STEP_METHODS = ("execute_model", "sample_tokens")
# per-token records (docs/records.md): started before the model forward, written on every way out
RECORD_START = "dispatch_logger.start_records(self, scheduler_output)"
RECORD_STEP = "dispatch_logger.record_step"
FORWARD_CALLS = ("self._model_forward", "self._generate_process_reqs_hidden_states")  # 0.18+ / 0.12-0.17


def _only_call(stmt: cst.BaseStatement) -> cst.Call | None:
    """The call of a one-expression statement line (`self.debugger.stop()`), else None."""
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
    ):
        value = stmt.body[0].value
        return value if isinstance(value, cst.Call) else None
    return None


def _is_finish(stmt: cst.BaseStatement) -> bool:
    call = _only_call(stmt)
    # `_finalize_dump_data(dump=False)` discards a dummy run's step: not a dumped model step
    return call is not None and call_name(call) in FINISH_CALLS and not call.args


DEBUGGER_CREATION = matchers.one_line(
    m.Assign(targets=[m.AssignTarget(target=matchers.name("self.debugger"))], value=m.Call())
)


def _is_debugger_creation(stmt: cst.BaseStatement) -> bool:
    return m.matches(stmt, DEBUGGER_CREATION)


def _binds(func: cst.FunctionDef, name: str) -> bool:
    """Is `name` a parameter of `func` or assigned (possibly by unpacking) in its body?"""
    if any(p.name.value == name for p in (*func.params.params, *func.params.kwonly_params)):
        return True
    found = False

    class _Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            nonlocal found
            found = found or _has_name(node.target, name)

    func.body.visit(_Targets())
    return found


def _has_name(node: cst.CSTNode, name: str) -> bool:
    if isinstance(node, cst.Name):
        return node.value == name
    if isinstance(node, (cst.Tuple, cst.List)):
        return any(_has_name(e.value, name) for e in node.elements)
    return False


class _Transformer(ScopedTransformer):
    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        self.method: str | None = None  # the NPUModelRunner method being walked

    # Only NPUModelRunner.__init__ / execute_model / sample_tokens are walked: the rest of the
    # file (5,000 lines and more) is left unvisited, which keeps a run well under a second.
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        super().visit_ClassDef(node)
        return self.qualname == CLASS

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        if self.method is not None:
            return True  # a function nested in a walked method
        if len(self.scope) != 2 or self.scope[0] != CLASS or self.scope[1] not in ("__init__", *STEP_METHODS):
            return False
        self.method = self.scope[1]
        if self.method in STEP_METHODS and not _binds(node, "scheduler_output"):
            self.ctx.fail(f"{self.method}: scheduler_output")
        return True

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname.count(".") == 1 and qualname.startswith(CLASS + "."):
            self.method = None
        if qualname == f"{CLASS}.execute_model":
            decorator = marked_decorator(self.ctx, RECORD_STEP)
            return updated.with_changes(decorators=[decorator, *updated.decorators])
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if self.method not in ("__init__", *STEP_METHODS):
            return updated
        statements: list[cst.BaseStatement] = []
        for stmt in updated.body:
            if self.method == "__init__" and _is_debugger_creation(stmt):
                self.ctx.hit("__init__: self.debugger = ...")
                statements.extend([stmt, self.ctx.statement(ATTACH)])
            elif self.method in STEP_METHODS and _is_finish(stmt):
                self.ctx.hit(f"{self.method}: dump finish point")
                self.ctx.hit(f"{self.method}: scheduler_output")
                statements.extend(insert_before(stmt, [self.ctx.statement(LOG)]))
            elif (
                self.method == "execute_model"
                and isinstance(stmt, cst.SimpleStatementLine)
                and any(contains_call(stmt, call) for call in FORWARD_CALLS)
            ):
                self.ctx.hit("execute_model: model forward")
                statements.extend(insert_before(stmt, [self.ctx.statement(RECORD_START)]))
            else:
                statements.append(stmt)
        return updated.with_changes(body=statements)


class VllmAscendModelRunner(Codemod):
    name = "vllm-ascend-model-runner"
    project = "vllm-ascend"
    path = "vllm_ascend/worker/model_runner_v1.py"
    anchors = {
        "__init__: self.debugger = ...": f"`self.debugger = PrecisionDebugger(...)` (or AclGraphDumper) "
        f"in {CLASS}.__init__ — vLLM-Ascend's own msprobe support (0.12.0rc1+)",
        "execute_model: dump finish point": f"`self.debugger.stop()` or `self._finalize_dump_data()` in {CLASS}.execute_model",
        "sample_tokens: dump finish point": f"`self.debugger.stop()` or `self._finalize_dump_data()` in {CLASS}.sample_tokens",
        "execute_model: scheduler_output": f"the name scheduler_output bound in {CLASS}.execute_model",
        "sample_tokens: scheduler_output": f"scheduler_output unpacked from the execute state in {CLASS}.sample_tokens",
        "execute_model: model forward": f"a statement in {CLASS}.execute_model calling "
        + " or ".join(f"{call}(...)" for call in FORWARD_CALLS),
    }

    helper_import = IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

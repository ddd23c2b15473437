"""Upstream vLLM V2 model runner: refuse to run while a rollout dump is asked for.

`vllm-dump` wires msprobe into the V1 runner only (`vllm_model_runner.py`). vLLM's V2 runner
(`vllm/v1/worker/gpu/model_runner.py`) is the default on newer releases and is chosen by
`VLLM_USE_V2_MODEL_RUNNER` (and forced by a few features); a dump run must set
`VLLM_USE_V2_MODEL_RUNNER=0`. So that a forgotten variable is an error and not a silent
run without dumps, this codemod adds two marked lines: the helper import and, as the first
statement of the V2 `GPUModelRunner.__init__`, `rl_msprobe_dump.refuse_v2_runner()` — which
does nothing unless MSPROBE_ROLLOUT_CONFIG is set, and then raises with the fix.

Why not patch V2 as well: its execute path changed shape in every release 0.24 → 0.33
(input batch, CUDA-graph dispatch, speculative and pooling runners moved around), and verl
works with the V1 runner throughout that range; one well-tested path beats two.
"""

from __future__ import annotations

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    StatusReport,
    TransformContext,
    after_docstring,
    body_of,
    insert_before,
    with_body,
)

HELPER_IMPORT = "from vllm.v1.worker import rl_msprobe_dump"
REQUIREMENT = "dumps need VLLM_USE_V2_MODEL_RUNNER=0: only the V1 runner is patched"


class _Transformer(ScopedTransformer):
    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname != "GPUModelRunner.__init__":
            return updated
        self.ctx.hit("GPUModelRunner.__init__")
        body = list(body_of(updated))
        index = after_docstring(body)
        guard = self.ctx.statement("rl_msprobe_dump.refuse_v2_runner()")
        if index < len(body):
            new = [*body[:index], *insert_before(body[index], [guard]), *body[index + 1 :]]
        else:
            new = [*body, guard]
        return with_body(updated, new)


class VllmModelRunnerV2(Codemod):
    name = "vllm-v2-runner-guard"
    project = "vllm"
    path = "vllm/v1/worker/gpu/model_runner.py"
    anchors = {"GPUModelRunner.__init__": "a method __init__ in class GPUModelRunner (the V2 runner)"}

    helper_import = HELPER_IMPORT

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Transformer(ctx)

    def status(self, source: str, version: str | None = None) -> StatusReport:
        """`patch status` says the requirement on this file's line, whatever its state."""
        report = super().status(source, version)
        return StatusReport(report.status, f"{report.detail}; {REQUIREMENT}")

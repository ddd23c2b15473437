"""SGLang weight sync: fingerprint lines in the engine's per-bucket update entry (the helper is
`sglang/srt/rl_msprobe_weights.py`, added by the same set; verl-weights' helper, same file).

verl hands SGLang each bucket of a sync through `update_weights_from_tensor(named_tensors,
load_format)`, which every TP rank's scheduler runs on its model: a method of `ModelRunner`
(`sglang/srt/model_executor/model_runner.py`, 0.4.6 ... 0.5.12) or of `WeightUpdater`
(`model_executor/model_runner_components/weight_updater.py`, later releases). In whichever
top-level class of the file defines that method:

- `@rl_msprobe_weights.engine_call` on `update_weights_from_tensor` (resident: each tensor the
  call carried, where the model holds it, when the call returns);
- `rl_msprobe_weights.call_received(self, X)` right after `X = [... _unwrap_tensor(...) ...]`
  (this rank's tensors, unpacked, before any loader sees them);
- where the class has `_update_weights_from_flattened_bucket` (0.5.1+), the same line after
  `X = ....reconstruct_tensors()`.

Shape decides: a file whose classes define no `update_weights_from_tensor` is not this codemod's
(`present`); one that does but lacks the unpacking or the bucket's reconstruction is an error.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

import libcst as cst

from rl_msprobe.codemods.base import (
    Codemod,
    ScopedTransformer,
    TransformContext,
    body_of,
    call_name,
    contains_call,
    top_level_classes,
    with_body,
)
from rl_msprobe.codemods.vllm_model_runner import marked_decorator

HELPER_IMPORT = "from sglang.srt import rl_msprobe_weights"
ENTRY = "update_weights_from_tensor"
BUCKET = "_update_weights_from_flattened_bucket"
UNWRAP = "_unwrap_tensor"
RECONSTRUCT = "reconstruct_tensors"


def entry_class(source: str) -> str | None:
    """The top-level class of SOURCE that defines `update_weights_from_tensor`, if any."""
    for name, node in top_level_classes(source).items():
        if any(isinstance(f, ast.FunctionDef) and f.name == ENTRY for f in node.body):
            return name
    return None


def _assigned(stmt: cst.BaseStatement, wanted: Callable[[cst.BaseExpression], bool]) -> str | None:
    """`X = <value>` with WANTED(value) true: X, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    return target.value if isinstance(target, cst.Name) and wanted(assign.value) else None


def _unpacked(value: cst.BaseExpression) -> bool:
    return contains_call(value, UNWRAP)


def _reconstructed(value: cst.BaseExpression) -> bool:
    name = call_name(value) or ""
    return name == RECONSTRUCT or name.endswith(f".{RECONSTRUCT}")


class _Transformer(ScopedTransformer):
    def __init__(self, ctx: TransformContext, cls: str) -> None:
        super().__init__(ctx)
        self.cls = cls
        self.targets = (f"{cls}.{ENTRY}", f"{cls}.{BUCKET}")
        self.has_bucket = False

    def _after(
        self, updated: cst.FunctionDef, wanted: Callable[[cst.BaseExpression], bool], anchor: str
    ) -> cst.FunctionDef:
        body: list[cst.BaseStatement] = []
        for stmt in body_of(updated):
            body.append(stmt)
            name = _assigned(stmt, wanted)
            if name is not None and anchor not in self.ctx.found:
                self.ctx.hit(anchor)
                body.append(self.ctx.statement(f"rl_msprobe_weights.call_received(self, {name})"))
        return with_body(updated, body)

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        if qualname == f"{self.cls}.{ENTRY}":
            self.ctx.hit("update entry")
            updated = self._after(updated, _unpacked, "unpacked tensors")
            decorator = marked_decorator(self.ctx, "rl_msprobe_weights.engine_call")
            return updated.with_changes(decorators=[decorator, *updated.decorators])
        if qualname == f"{self.cls}.{BUCKET}":
            self.has_bucket = True
            return self._after(updated, _reconstructed, "flattened bucket")
        return updated


class SGLangWeightsReceived(Codemod):
    name = "sglang-weights-received"
    project = "sglang"
    path = "sglang/srt/model_executor/model_runner.py"
    anchors = {
        "update entry": f"a top-level class with a method {ENTRY}(self, named_tensors, load_format=None)",
        "unpacked tensors": f"in {ENTRY}: an assignment `X = [(name, {UNWRAP}(...)) for ...]`",
        "flattened bucket": f"in {BUCKET}: an assignment `X = bucket.{RECONSTRUCT}()`",
    }
    helper_import = HELPER_IMPORT

    def present(self, source: str) -> bool:
        return entry_class(source) is not None

    def subject_text(self) -> str:
        return f"class with a method {ENTRY}"

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        cls = entry_class(ctx.module.code)
        if cls is None:
            ctx.fail("update entry")
        return _Transformer(ctx, cls)

    def after_visit(self, transformer: cst.CSTTransformer, ctx: TransformContext) -> None:
        if isinstance(transformer, _Transformer) and not transformer.has_bucket:
            ctx.waive("flattened bucket")  # before 0.5.1: no flattened-bucket path


class SGLangWeightsUpdater(SGLangWeightsReceived):
    """The same lines where SGLang moved the entry out of ModelRunner (class WeightUpdater)."""

    name = "sglang-weights-updater"
    path = "sglang/srt/model_executor/model_runner_components/weight_updater.py"

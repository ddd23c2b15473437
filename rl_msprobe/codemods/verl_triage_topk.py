"""verl: the distribution at every response position for triage, without storing logits.

Three sites, each found by its shape (a file without it fails loudly):

- the vLLM rollout server (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``,
  ``generate``): verl asks vLLM for the sampled token's log-prob only
  (``sampling_params["logprobs"] = 0 if ... else None``); one line after it asks for the top k
  (``RL_MSPROBE_TRIAGE_TOPK=k``), and one line after verl reads the sampled token's log-probs
  (``X = [... for i, logprobs in enumerate(<out>.logprobs)]``) keeps the top-k ids and
  log-probs and the prompt ids vLLM received in the output's ``extra_fields``, which verl's
  agent loop carries into the batch's ``non_tensor_batch``;
- the trainer (``verl/trainer/ppo/ray_trainer.py``, ``_compute_old_log_prob``): around
  ``<out> = self.actor_rollout_wg.compute_log_prob(<td>)`` the rollout's top-k ids go to the
  workers as one padded tensor of the TensorDict, and the training engine's per-position
  numbers come back out of the output;
- the FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``, ``prepare_model_outputs``):
  after each ``<lp> = logprobs_from_logits(logits=<logits>, labels=<labels>, ...)`` (the one
  place the full-vocabulary logits exist, already divided by the temperature), the helper takes,
  at the response positions only, the logsumexp (the label's logit minus verl's log-prob: no
  pass over the vocabulary), the log-probs of the rollout's top-k ids and its own top k into
  ``model_output`` (verl returns every key of it to the trainer; the entropy is verl's own).
  The cheapest correct site: the logits are there anyway, so the extra work is one copy of the
  response rows, one top-k and one gather, never a second forward. (Forward only: verl's
  ``inplace_backward`` overwrites the logits in the backward, which the old-log-prob call has not.)

All lines are no-ops unless ``RL_MSPROBE_TRIAGE`` and ``RL_MSPROBE_TRIAGE_TOPK`` are set.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from rl_msprobe.codemods import matchers
from rl_msprobe.codemods.base import Codemod, TransformContext, insert_before

IMPORT = "from verl.utils import rl_msprobe_triage"


def _names_assigned(node: cst.CSTNode) -> set[str]:
    found: set[str] = set()

    class _V(cst.CSTVisitor):
        def visit_AssignTarget(self, t: cst.AssignTarget) -> None:
            if isinstance(t.target, cst.Name):
                found.add(t.target.value)

        def visit_Param(self, p: cst.Param) -> None:
            found.add(p.name.value)

    node.visit(_V())
    return found


class _InFunction(cst.CSTTransformer):
    """Rewrites the blocks of every function named FUNC (checking the names its lines use)."""

    func = ""

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.stack: list[set[str]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.stack.append(_names_assigned(node) if node.name.value == self.func else set())
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.BaseStatement:
        self.stack.pop()
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if not self.stack or not self.stack[-1]:
            return updated
        return updated.with_changes(body=self.rewrite(updated.body, self.stack[-1]))

    def rewrite(self, body: Sequence[cst.BaseStatement], names: set[str]) -> list[cst.BaseStatement]:
        raise NotImplementedError


# ---------------------------------------------------------------------------- the vLLM server

ASK = "logprobs request"
KEEP = "sampled log-probs"

# sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
_ASKS = matchers.one_line(
    m.Assign(
        targets=[m.AssignTarget(target=m.Subscript(value=matchers.saves(m.Name())))],
        value=m.IfExp(body=m.Integer("0"), orelse=m.Name("None")),
    )
)
_LOGPROBS_KEY = m.SubscriptElement(slice=m.Index(value=m.SimpleString('"logprobs"')))


def _asks(stmt: cst.BaseStatement) -> str | None:
    name = matchers.saved_name(stmt, _ASKS)
    if name is None:
        return None
    target = stmt.body[0].targets[0].target  # type: ignore[attr-defined]
    return name if m.matches(target.slice[0], _LOGPROBS_KEY) else None


def _sampled_output(stmt: cst.BaseStatement) -> str | None:
    """`X = [... for i, logprobs in enumerate(<out>.logprobs)]` -> the source of <out>."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(value=m.ListComp())])):
        return None
    comp = stmt.body[0].value.for_in  # type: ignore[attr-defined]
    it = comp.iter
    if not m.matches(
        it, m.Call(func=m.Name("enumerate"), args=[m.Arg(value=m.Attribute(attr=m.Name("logprobs")))])
    ):
        return None
    return cst.Module(body=[]).code_for_node(it.args[0].value.value)


class _Server(_InFunction):
    func = "generate"

    def rewrite(self, body: Sequence[cst.BaseStatement], names: set[str]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for stmt in body:
            out.append(stmt)
            params = _asks(stmt)
            if params is not None:
                self.ctx.hit(ASK)
                out.extend(self.ctx.statements(f"{IMPORT}\nrl_msprobe_triage.ask_top_k({params})"))
            source = _sampled_output(stmt)
            if source is not None and {"prompt_ids", "extra_fields"} <= names:
                self.ctx.hit(KEEP)
                out.extend(
                    self.ctx.statements(
                        f"{IMPORT}\nrl_msprobe_triage.keep_top_k({source}, prompt_ids, extra_fields)"
                    )
                )
        return out


class VerlTriageVllmServer(Codemod):
    name = "verl-triage-vllm-server"
    project = "verl"
    path = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
    anchors = {
        ASK: '`sampling_params["logprobs"] = 0 if ... else None` in `generate` (verl asks vLLM for log-probs)',
        KEEP: "`log_probs = [... for i, logprobs in enumerate(<output>.logprobs)]` in `generate`, which has "
        "`prompt_ids` and `extra_fields`",
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Server(ctx)


# ---------------------------------------------------------------------------- the trainer

CALL = "compute_log_prob call"

# <out> = self.actor_rollout_wg.compute_log_prob(<td>)
_COMPUTES = matchers.one_line(
    m.Assign(
        targets=[m.AssignTarget(target=matchers.saves(m.Name()))],
        value=m.Call(
            func=m.Attribute(value=matchers.DOTTED, attr=m.Name("compute_log_prob")),
            args=[m.Arg(value=m.Name())],
        ),
    )
)


class _Trainer(_InFunction):
    func = "_compute_old_log_prob"

    def rewrite(self, body: Sequence[cst.BaseStatement], names: set[str]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for stmt in body:
            target = matchers.saved_name(stmt, _COMPUTES)
            if target is None or "batch" not in names:
                out.append(stmt)
                continue
            self.ctx.hit(CALL)
            td = stmt.body[0].value.args[0].value.value  # type: ignore[attr-defined]
            before = self.ctx.statements(f"{IMPORT}\nrl_msprobe_triage.send_rollout_top_k(batch, {td})")
            out.extend(insert_before(stmt, before))
            out.extend(self.ctx.statements(f"{IMPORT}\nrl_msprobe_triage.keep_train_top_k({target})"))
        return out


class VerlTriageOldLogProb(Codemod):
    name = "verl-triage-old-log-prob"
    project = "verl"
    path = "verl/trainer/ppo/ray_trainer.py"
    anchors = {
        CALL: "`<output> = self.actor_rollout_wg.compute_log_prob(<tensordict>)` in `_compute_old_log_prob(self, batch)`"
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Trainer(ctx)


# ---------------------------------------------------------------------------- the FSDP engine

LOGITS = "logprobs_from_logits call"

# log_probs = logprobs_from_logits(logits=<logits>, labels=..., ...)
_LOG_PROBS = matchers.one_line(
    m.Assign(
        value=m.Call(
            func=m.Name("logprobs_from_logits"),
            args=[m.Arg(keyword=m.Name("logits"), value=matchers.saves(m.Name())), m.ZeroOrMore()],
        )
    )
)


def _log_probs_call(stmt: cst.BaseStatement) -> tuple[str, str, str] | None:
    """`X = logprobs_from_logits(logits=L, labels=Y, ...)` -> (L, X, the source of Y)."""
    logits = matchers.saved_name(stmt, _LOG_PROBS)
    if logits is None:
        return None
    assign = stmt.body[0]  # type: ignore[attr-defined]
    target = assign.targets[0].target
    labels = next((a.value for a in assign.value.args if a.keyword and a.keyword.value == "labels"), None)
    if not isinstance(target, cst.Name) or labels is None:
        return None
    return logits, target.value, cst.Module(body=[]).code_for_node(labels)


class _Engine(_InFunction):
    func = "prepare_model_outputs"

    def rewrite(self, body: Sequence[cst.BaseStatement], names: set[str]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for stmt in body:
            out.append(stmt)
            found = _log_probs_call(stmt)
            if found is None or not {"micro_batch", "model_output"} <= names:
                continue
            self.ctx.hit(LOGITS)
            logits, log_probs, labels = found
            call = (
                f"rl_msprobe_triage.train_top_k({logits}, micro_batch, model_output, {log_probs}, {labels})"
            )
            out.extend(self.ctx.statements(f"{IMPORT}\n{call}"))
        return out


class VerlTriageFsdpEngine(Codemod):
    name = "verl-triage-fsdp-engine"
    project = "verl"
    path = "verl/workers/engine/fsdp/transformer_impl.py"
    anchors = {
        LOGITS: "`log_probs = logprobs_from_logits(logits=<logits>, ...)` in `prepare_model_outputs(self, output, "
        "output_args, micro_batch, ...)` with its `model_output` dict"
    }

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        return _Engine(ctx)

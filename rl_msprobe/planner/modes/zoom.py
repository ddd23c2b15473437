"""The zoom (`prepare --mode consistency --zoom REPORT`): msprobe where it is the right instrument.

From the first divergence a `dumps positions` report names (request, position, module, layer), plan
msprobe `mix` dumps (API level) of only that layer's block (msprobe's `list`: the rollout's module
names and the training side's, FSDP1's `_fsdp_wrapped_module` included), only that request's rows
(msprobe 26.2's `request_id` slice: the vllm-dump helper hands msprobe the step's scheduled tokens in
the runner's row order; the verl engine helper sets the slice to the request's rows of the packed
micro-batch), and only the prompt's forward (`PROMPTS_ONLY=1`, `MSPROBE_ROLLOUT_PHASES=prefill`).
msprobe's compare of the two dumps, read by `rl_msprobe.dumps.zoom_operator.first_operator`, names
the API call inside the block where the difference starts.

A decode position is refused: msprobe compares two dumps of the same forward. A decode step is a
one-token forward reading the KV cache; the training forward computes every position in one pass,
so its attention calls hold the whole sequence and only the per-row calls (linear, norm, the
activation's multiply) would line up with one decode row. The rows of a decode position are
compared by `dumps positions` (per-token records of every module's input and output), which is
where such a divergence was found; the zoom covers positions of the prompt.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_msprobe.errors import UserError
from rl_msprobe.planner.modes.base import ConfigSpec, Context, Requirements, Violation
from rl_msprobe.planner.modes.rules import EnvRule, apply

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_WRAPPER = "_fsdp_wrapped_module."


@dataclass(frozen=True)
class ZoomTarget:
    """What the zoom dumps: one request (its base id), one decoder layer, optionally one block of it
    (`mlp`, `self_attn`, ...), at a position (None: the prompt)."""

    request_id: str
    layer: int
    module: str | None = None  # the divergent module as the report names it
    position: int | None = None
    phase: str | None = None  # prefill | decode, when the report says
    prompt_len: int | None = None

    @property
    def block(self) -> str | None:
        """The layer's child holding the module (`mlp` of model.layers.3.mlp.down_proj): the same name
        on both engines where the leaves differ (vLLM's fused qkv_proj / gate_up_proj)."""
        if not self.module:
            return None
        name = self.module.removeprefix("Module.").replace(_WRAPPER, "")
        found = _LAYER.search(name)
        rest = name[found.end() :] if found else name
        head = rest.split(".", 1)[0]
        return head or None


def _from_requests(doc: dict[str, Any]) -> dict[str, Any] | None:
    """`dumps positions --json` (rl-msprobe.dumps-positions/1): each divergent request's
    `positions.first` (start, phase, module, layer) with the request's id and prompt length; a
    divergence in the prompt first (what the zoom can dump), else the first divergent request."""
    found = []
    for item in doc.get("requests") or ():
        positions = item.get("positions") if isinstance(item, dict) else None
        if not isinstance(positions, dict):
            continue
        first = positions.get("first")
        if not isinstance(first, dict) or not first.get("module") or item.get("request_id") in (None, ""):
            continue
        found.append(
            {
                "request_id": item["request_id"],
                "module": first["module"],
                "layer": first.get("layer"),
                "position": first.get("start"),
                "phase": first.get("phase"),
                "prompt_len": positions.get("prompt"),
            }
        )
    return next((f for f in found if f["phase"] == "prefill"), found[0] if found else None)


def _first(doc: Any) -> dict[str, Any] | None:
    """The first divergence in a `dumps positions --json` document (`_from_requests`), else read
    defensively (a shape that names it first_divergence, first, or lists divergences / findings)."""
    if not isinstance(doc, dict):
        return None
    from_requests = _from_requests(doc)
    if from_requests is not None:
        return from_requests
    for key in ("first_divergence", "first", "divergence"):
        value = doc.get(key)
        if isinstance(value, dict):
            return value
    for key in ("divergences", "findings", "requests", "pairs", "results"):
        items = doc.get(key)
        if isinstance(items, list):
            for item in items:
                found = _first(item) if isinstance(item, dict) else None
                if found is not None:
                    return found
                if (
                    isinstance(item, dict)
                    and _pick(item, "request_id", "request")
                    and _pick(item, "module", "key")
                ):
                    return item
    if _pick(doc, "request_id", "request") and _pick(doc, "module", "key"):
        return doc
    return None


def _pick(doc: dict[str, Any], *keys: str) -> Any:
    return next((doc[k] for k in keys if doc.get(k) not in (None, "")), None)


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def read_report(path: str) -> dict[str, Any]:
    """The first divergence of a `dumps positions --json` report as {request_id, position, module,
    layer, phase, prompt_len} (values the report lacks are None)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--zoom {path}: cannot read it as JSON ({exc}); pass `dumps positions --json`'s output."
        ) from None
    first = _first(doc)
    if first is None:
        raise UserError(
            f"--zoom {path}: the report names no first divergence (nothing diverged, or not a `dumps positions "
            "--json` report); give the target by hand: --zoom-request ID --zoom-layer N [--zoom-module NAME]."
        )
    module = _pick(first, "module", "key", "name")
    layer = _int(_pick(first, "layer"))
    if layer is None and isinstance(module, str):
        found = _LAYER.search(module)
        layer = int(found.group(1)) if found else None
    return {
        "request_id": _pick(first, "request_id", "request"),
        "position": _int(_pick(first, "position", "pos")),
        "module": module,
        "layer": layer,
        "phase": _pick(first, "phase"),
        "prompt_len": _int(_pick(first, "prompt_len", "prompt_length")),
    }


def zoom_target(
    report: str | None,
    request: str | None,
    layer: int | None,
    module: str | None,
    position: int | None,
) -> ZoomTarget | None:
    """The zoom from --zoom REPORT and / or the --zoom-* flags (a flag wins over the report); None
    when neither is given."""
    if report is None and request is None and layer is None and module is None and position is None:
        return None
    found = read_report(report) if report else {}
    rid = request or found.get("request_id")
    lay = layer if layer is not None else found.get("layer")
    if module is not None and lay is None:
        hit = _LAYER.search(module)
        lay = int(hit.group(1)) if hit else None
    if not rid or lay is None:
        raise UserError(
            "the zoom needs a request and a layer: --zoom REPORT (dumps positions --json), or --zoom-request ID "
            "--zoom-layer N [--zoom-module NAME] [--zoom-position P]."
        )
    target = ZoomTarget(
        request_id=_base_id(str(rid)),
        layer=int(lay),
        module=module or found.get("module"),
        position=position if position is not None else found.get("position"),
        phase=None if position is not None else found.get("phase"),
        prompt_len=found.get("prompt_len"),
    )
    _refuse_decode(target)
    return target


_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def _base_id(rid: str) -> str:
    """verl's id: vLLM's `-<8 hex>` and SGLang PD's `_P` dropped (dumps.correlate.strip_request_id's rule)."""
    text = _VLLM_SUFFIX.sub("", rid) if len(rid) > 9 else rid
    return text[:-2] if text.endswith("_P") else text


def _refuse_decode(target: ZoomTarget) -> None:
    decode = target.phase == "decode" or (
        target.position is not None and target.prompt_len is not None and target.position >= target.prompt_len
    )
    if decode:
        raise UserError(
            f"--zoom: position {target.position} of request {target.request_id} is a response (decode) position. "
            "msprobe compares two dumps of the same forward: a decode step is a one-token forward over the KV "
            "cache, the training forward computes every position at once, so their attention calls cannot be "
            "paired row for row. `rl-msprobe dumps positions` compares that position module by module "
            "(RL_MSPROBE_RECORD_LAYERS / RL_MSPROBE_RECORD_MODULES narrow it to the layer); the zoom covers "
            "prompt positions."
        )


def msprobe_lists(target: ZoomTarget) -> dict[str, list[str]]:
    """msprobe `list` entries (substrings of module names; at mix level every API call inside a
    matching module is dumped) per config role: the rollout's names, the trainer's (FSDP1 wraps
    each decoder layer in `_fsdp_wrapped_module`; FSDP2 keeps the names)."""
    block = target.block
    layer = f"layers.{target.layer}."
    rollout = [f"{layer}{block}."] if block else [layer]
    train = [*rollout, f"{layer}{_WRAPPER}{block}."] if block else [layer]
    return {"generate": rollout, "actor": train, "prefill": rollout}


PHASES = EnvRule(
    "consistency.zoom.env.MSPROBE_ROLLOUT_PHASES",
    "MSPROBE_ROLLOUT_PHASES",
    "prefill",
    "the zoom compares the prompt's forward: the vllm-dump helper dumps prefill steps only",
)
PROMPTS = EnvRule(
    "consistency.zoom.env.PROMPTS_ONLY",
    "PROMPTS_ONLY",
    "1",
    "the zoom compares the prompt's forward: the trainer dumps its prompts-only copy forward",
)


def apply_zoom(ctx: Context, req: Requirements, target: ZoomTarget) -> None:
    """The zoom's changes to a consistency plan: the configs' request_id and list, the prefill only."""
    if ctx.options.level != "mix":
        req.violations.append(
            Violation(
                "consistency.zoom.level",
                "--level",
                ctx.options.level,
                "mix",
                "the zoom names an operator: msprobe must dump the API calls inside the modules (level mix)",
            )
        )
    if ctx.rollout != "vllm" or ctx.detection.device == "npu":
        engine = (
            "SGLang"
            if ctx.rollout == "sglang"
            else "vLLM-Ascend"
            if ctx.detection.device == "npu"
            else ctx.rollout
        )
        req.violations.append(
            Violation(
                "consistency.zoom.engine",
                "rollout engine",
                str(engine),
                "vllm (GPU, V1 model runner)",
                "the zoom cuts one request out of a batched step with msprobe's request slice, which the vllm-dump "
                f"helper drives from the V1 runner's rows; {engine}'s own msprobe path passes no scheduled tokens",
            )
        )
    lists = msprobe_lists(target)
    req.configs[:] = [_zoomed(spec, target, lists) for spec in req.configs]
    apply(ctx, req, [PHASES, PROMPTS])
    where = f"{target.block} of layer {target.layer}" if target.block else f"layer {target.layer}"
    # the folder holding actor/ and generate/: a command that pastes as printed (no <placeholder>)
    parents = {os.path.dirname(spec.dump_path.rstrip("/")) for spec in req.configs if spec.dump_path}
    folder = parents.pop() if len(parents) == 1 else ctx.dump_dir
    req.notes.append(
        f"Zoom: msprobe mix dumps of {where} only, request {target.request_id} only (msprobe's request_id "
        f"slice), its prompt's forward on both sides. After the run, `rl-msprobe dumps zoom {shlex.quote(folder)}` "
        "(actor/ and generate/ below it) runs msprobe's compare of the two and names the API call where it starts."
    )
    req.notes.append(
        f"Zoom: request {target.request_id} must carry the same id in this run: the verl-consistency set sends "
        "stable ids (rlm<digest of the agent-loop worker and the prompt>n<k>), the same when this script runs "
        "the same steps as the run the report read (--steps: through the report's step). With another id "
        "(verl's fresh uuid: a report of a run without the set), msprobe dumps nothing and logs that the "
        "request was not among the scheduled tokens."
    )


def _zoomed(spec: ConfigSpec, target: ZoomTarget, lists: dict[str, list[str]]) -> ConfigSpec:
    from dataclasses import replace

    names = lists.get(spec.role)
    if names is None:
        return spec
    return replace(spec, task_fields=(("request_id", target.request_id), ("list", names)))

"""Per-expert MoE tensor names. The engine holds a layer's experts stacked (vLLM / SGLang FusedMoE:
`w13_weight` [E, 2I, H], `w2_weight` [E, H, I]); the job-side helper splits them back into the names
the trainer sends, `...layers.{L}....experts.{E}.{projection}.weight`, so every stage compares one
expert's projection at a time. Here a finding's name is read back as (layer, expert, projection):
what a report says where an expert differs."""

from __future__ import annotations

import re
from typing import TypedDict

EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)\.weight$")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertDoc(TypedDict):
    layer: int | None  # None: no `layers.{L}.` in the name
    expert: int
    projection: str  # gate_proj / up_proj / down_proj (Mixtral: w1 / w3 / w2)


def expert_of(name: str) -> ExpertDoc | None:
    """(layer, expert, projection) of a per-expert tensor name; None for any other tensor."""
    match = EXPERT.search(name)
    if match is None:
        return None
    layer = LAYER.search(name[: match.start() + 1])
    return {
        "layer": int(layer.group(1)) if layer else None,
        "expert": int(match.group(1)),
        "projection": match.group(2),
    }


def expert_text(name: str) -> str:
    """` (layer 1, expert 2, up_proj)` for a per-expert name, else empty: appended to a finding."""
    doc = expert_of(name)
    if doc is None:
        return ""
    layer = "" if doc["layer"] is None else f"layer {doc['layer']}, "
    return f" ({layer}expert {doc['expert']}, {doc['projection']})"

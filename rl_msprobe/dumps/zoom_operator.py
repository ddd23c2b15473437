"""The operator a zoom names: the first API call in msprobe's compare of two zoomed dumps (level
mix, one layer's modules, one request's rows) whose output differs while its inputs agree.

msprobe's `compare` (plain, by name: at mix level `--consistent_check` maps modules, not API
calls) writes one CSV row per tensor of each call, in forward order, with both sides' statistics.
rl-msprobe judges on those statistics (Max, Min, L2 norm) itself, as `dumps compare` does: the
Result column marks a [1, N, H] training row against an [N, H] rollout row as an error whatever the
numbers say. The call's parent module comes from msprobe's `construct.json` beside the dump.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

API_PREFIXES = ("Functional.", "Torch.", "Tensor.", "Aten.", "NPU.", "VF.", "Distributed.", "MindSpeed.")
_CALL = re.compile(r"^(?P<call>.+?\.\d+\.forward)\.(?P<kind>input|output|parameters)")
STATS = (("NPU max", "Bench max"), ("NPU min", "Bench min"), ("NPU l2norm", "Bench l2norm"))


@dataclass(frozen=True)
class Operator:
    """One API call of the zoomed module: its msprobe name, the module it runs in, its error."""

    call: str  # Functional.linear.3.forward
    module: str | None  # Module.model.layers.1.mlp.MLP.forward.0 (construct.json), None when unknown
    rel_error: float  # the largest relative difference of its outputs' Max / Min / L2 norm
    input_error: float

    @property
    def api(self) -> str:
        """The API without its counter: Functional.linear, Tensor.__mul__."""
        return self.call.rsplit(".", 2)[0]


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "", "N/A", "None") else None
    except ValueError:
        return None


def _rel(row: dict[str, str]) -> float:
    worst = 0.0
    for npu, bench in STATS:
        a, b = _float(row.get(npu)), _float(row.get(bench))
        if a is None or b is None:
            continue
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def _calls(csv_path: Path) -> list[tuple[str, float, float]]:
    """(call, output error, input error) of every API call, in the CSV's (forward) order."""
    order: list[str] = []
    errors: dict[str, list[float]] = {}
    from rl_msprobe import bounded

    with bounded.open_text(csv_path, "msprobe compare_result CSV", bounded.DUMP_JSON) as handle:
        for row in csv.DictReader(handle):
            name = row.get("NPU Name") or ""
            found = _CALL.match(name)
            if not name.startswith(API_PREFIXES) or found is None:
                continue
            call = found["call"]
            if call not in errors:
                order.append(call)
                errors[call] = [0.0, 0.0]
            if found["kind"] == "output":
                errors[call][0] = max(errors[call][0], _rel(row))
            elif name.endswith(".input.0"):  # the activation; a differing weight is the operator's own
                errors[call][1] = max(errors[call][1], _rel(row))
    return [(call, errors[call][0], errors[call][1]) for call in order]


def parents(dump_json: Path) -> dict[str, str | None]:
    """msprobe's construct.json beside DUMP_JSON: each node's parent module (empty when absent)."""
    path = dump_json.with_name("construct.json")
    from rl_msprobe import bounded
    from rl_msprobe.errors import UserError

    try:
        doc = json.loads(bounded.read_text(path, "msprobe construct.json", bounded.DUMP_JSON))
    except (OSError, ValueError, RecursionError, UserError):
        return {}
    return {str(k): (str(v) if v else None) for k, v in doc.items()} if isinstance(doc, dict) else {}


def first_operator(csv_path: Path, dump_json: Path | None = None, tolerance: float = 1e-3) -> Operator | None:
    """The first API call whose outputs differ by more than TOLERANCE (relative, on Max / Min / L2
    norm) while its first input (the activation) differs by at most TOLERANCE: the operator where the difference starts.
    None when every call agrees."""
    owners = parents(dump_json) if dump_json is not None else {}
    for call, out_err, in_err in _calls(csv_path):
        if out_err > tolerance and in_err <= tolerance:
            return Operator(call, owners.get(call), out_err, in_err)
    return None

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


@dataclass(frozen=True)
class ZoomOutcome:
    """`dumps zoom`: msprobe's plain compare of a zoom's two dumps, and the operator it names."""

    actor: Path  # the training side's dump.json
    rollout: Path  # the rollout side's dump.json
    csv: Path
    operator: Operator | None
    skipped: tuple[Path, ...] = ()  # further dump.json files of the zoom (other TP ranks / micro-batches)

    @property
    def ok(self) -> bool:
        """Exit 0 when the difference was placed on an operator."""
        return self.operator is not None

    def to_json(self) -> dict[str, object]:
        op = self.operator
        return {
            "schema": "rl-msprobe.dumps-zoom/1",
            "actor": str(self.actor),
            "rollout": str(self.rollout),
            "csv": str(self.csv),
            "operator": None
            if op is None
            else {
                "call": op.call,
                "api": op.api,
                "module": op.module,
                "rel_error": op.rel_error,
                "input_error": op.input_error,
            },
            "skipped": [str(p) for p in self.skipped],
        }

    def lines(self) -> list[str]:
        op = self.operator
        head = (
            f"operator: {op.api} ({op.call}) in {op.module or 'a module construct.json does not name'}: its output "
            f"differs by {op.rel_error:.3g} (relative, Max / Min / L2 norm) while its input differs by "
            f"{op.input_error:.3g}"
            if op is not None
            else "operator: none: every API call of the zoomed block agrees (within 1e-3), or the two dumps hold "
            "no API call of the same name (level mix? the same block on both sides?)"
        )
        return [
            head,
            f"compared: {self.actor} (training) against {self.rollout} (rollout)",
            f"msprobe's compare: {self.csv}",
            *(f"not compared (one pair is read): {p}" for p in self.skipped),
        ]


def _dump_files(side: Path) -> list[Path]:
    """SIDE's msprobe dump.json files that hold data (msprobe writes empty ones for steps it skipped)."""
    from rl_msprobe import bounded
    from rl_msprobe.dumps.layout import walk_files
    from rl_msprobe.errors import UserError

    found = []
    for path in walk_files(side, {"dump.json"}):
        try:
            if json.loads(bounded.read_text(path, "msprobe dump.json", bounded.DUMP_JSON)).get("data"):
                found.append(path)
        except (OSError, ValueError, AttributeError, RecursionError, UserError):
            continue  # empty, cut short, not JSON or not a regular file: not a dump to compare
    return found


def zoom_compare(dump: Path, out: Path, python: str | None = None, timeout: float = 600) -> ZoomOutcome:
    """Find the zoom's two dumps under DUMP (`actor/` and `generate/`, as `prepare --zoom` lays them
    out), run msprobe's plain compare of them (`compare -tp actor -gp rollout`, by API name) in
    PYTHON (default: the one `prepare` recorded), and name the first operator (`first_operator`)."""
    from rl_msprobe.dumps.compare import recorded_python
    from rl_msprobe.dumps.runners import ProcessRunner, interpreter
    from rl_msprobe.errors import UserError

    sides = {name: _dump_files(dump / name) for name in ("actor", "generate")}
    for name, files in sides.items():
        if not files:
            raise UserError(
                f"{dump / name}: no msprobe dump.json with data. Pass the zoom's dump folder (prepare --zoom's "
                "dump_path parent, holding actor/ and generate/), after a run that reached the zoomed request: "
                "its id must be among the run's requests (the dispatch log under generate/ lists them)."
            )
    if python is None:
        python, _ = recorded_python([dump])
    out.mkdir(parents=True, exist_ok=True)
    actor, rollout = sides["actor"][0], sides["generate"][0]
    log = out / "msprobe_compare.log"
    args = ["compare", "-tp", str(actor), "-gp", str(rollout), "-o", str(out)]
    code = ProcessRunner(interpreter(python)).run(args, log, timeout)
    tables = sorted(out.glob("compare_result_*.csv"), key=lambda p: p.stat().st_mtime)
    if code != 0 or not tables:
        tail = log.read_text(encoding="utf-8", errors="replace")[-1500:] if log.exists() else ""
        raise UserError(f"msprobe's compare of {actor} and {rollout} failed ({code}); its log {log}:\n{tail}")
    skipped = tuple(sides["actor"][1:] + sides["generate"][1:])
    return ZoomOutcome(actor, rollout, tables[-1], first_operator(tables[-1], actor), skipped)

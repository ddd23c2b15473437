"""The `mismatch report` operation, callable from Python without click.

`mismatch_report` streams a triage run's lines, proposes the step (and request) to dump next and
writes the report folder; its frozen result carries an enum for what was found, its own
`--json` document (`to_json`, schema in docs/json.md) and its terminal text (`lines`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_msprobe.triage.distribution_report import DistributionResult
    from rl_msprobe.triage.propose import Growth, Proposal
    from rl_msprobe.triage.stream import Triage

SCHEMA = "rl-msprobe.mismatch-report/1"


class Found(str, enum.Enum):
    """How far the report got: only REQUEST (a request to dump proposed) exits 0."""

    REQUEST = "request"  # a step and its worst request: the one-prompt data file was written
    STEP_ONLY = "step only"  # a step, but no request with response tokens in it
    NOTHING = "nothing"  # no step with both gaps: no request with response tokens at all


@dataclass(frozen=True)
class MismatchReport:
    """A written `mismatch report`: the streamed triage, its growth, the proposal and the files."""

    triage: Triage
    growth: Growth | None
    proposal: Proposal | None
    paths: dict[str, str]
    notes: tuple[str, ...]
    distribution: DistributionResult | None = None  # the distribution per position and the causes
    routing: Any = None  # triage/routing.py's Routing, when the folder has MoE routing records

    @property
    def found(self) -> Found:
        if self.proposal is None:
            return Found.NOTHING
        return Found.STEP_ONLY if self.proposal.request is None else Found.REQUEST

    @property
    def ok(self) -> bool:
        return self.found is Found.REQUEST

    def to_json(self) -> dict[str, Any]:
        from rl_msprobe.triage.report import summary_json

        doc = summary_json(self.triage, self.growth, self.proposal, self.paths, self.distribution)
        doc["routing"] = self.routing.to_json() if self.routing is not None else None
        return {"schema": SCHEMA, **doc, "notes": list(self.notes)}

    def lines(self) -> list[str]:
        from rl_msprobe.triage.report import fmt

        t = self.triage
        out = [f"{t.requests} request(s), {len(t.steps)} step(s) from {len(t.files)} file(s)"]
        for s in t.step_list():
            d, lp = s.gaps.get("dp"), s.gaps.get("dlogp")
            if d and lp:
                out.append(
                    f"  step {s.step}: mean |Δp| {fmt(d.mean())}  max {fmt(d.peak)}   "
                    f"mean |Δ log p| {fmt(lp.mean())}  p99 {fmt(lp.quantile(0.99))}  max {fmt(lp.peak)}"
                )
        if t.error_count or t.bad_count:
            out.append(f"{t.error_count} error line(s), {t.bad_count} unreadable line(s): see the report")
        dist = self.distribution
        if dist is not None and dist.present:
            for sd in dist.step_list():
                out.append(
                    f"  step {sd.step}: KL(rollout ‖ train) ≥ {fmt(sd.sums.mean('kl_low'))}  top-1 agree "
                    f"{fmt(sd.sums.mean('top1'))}  top-k overlap {fmt(sd.sums.mean('overlap'))}  "
                    f"verdict: {', '.join(c.name for c in sd.causes) or 'no gap'}"
                )
        for cause in dist.semantic if dist is not None else []:
            out.append(f"cause: {cause.name}: {'; '.join(cause.evidence)}")
            out += [f"  fix: {f}" for f in cause.fix]
        if dist is not None and dist.semantic:
            out.append("next: fix the semantic cause(s) above; if a gap stays, then a consistency dump:")
        if self.routing is not None:
            from rl_msprobe.triage.routing_report import verdict

            out.append(f"routing: {verdict(self.routing) or 'agrees (every compared token, every layer)'}")
        if self.proposal is not None:
            out.append(f"next: dump step {self.proposal.step} ({self.proposal.why})")
            out += [f"  {cmd}" for cmd in self.proposal.commands]
        out += [f"note: {note}" for note in self.notes]
        return [*out, f"report: {self.paths['md']}\n        {self.paths['html']}"]


def mismatch_report(
    folder: Path,
    out: Path | None = None,
    script: Path | None = None,
    tree: str | None = None,
    python: str | None = None,
    keep: int = 10,
    force: bool = False,
) -> MismatchReport:
    """Stream FOLDER's <pid>/triage.jsonl lines into report.md / report.html / PNGs / summary.json
    in `out` (default FOLDER/report), with the proposed consistency dump when a step stands out.

    `script`, `tree`, `python`: the job's launch script, verl tree and interpreter the proposed
    `prepare` command names (python defaults to the one `prepare --python` recorded); `keep`:
    worst requests listed; `force`: replace files in `out` rl-msprobe did not write.
    """
    from rl_msprobe.dumps.compare import recorded_python
    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.triage.distribution_report import read_distribution, script_settings
    from rl_msprobe.triage.propose import choose, growth, write_proposal
    from rl_msprobe.triage.report import write_report
    from rl_msprobe.triage.routing import read_routing
    from rl_msprobe.triage.routing_report import verdict
    from rl_msprobe.triage.stream import read_triage

    out = (out or (folder if folder.is_dir() else folder.parent) / "report").resolve()
    result = read_triage(folder, keep=keep)
    dist = read_distribution(folder, script_settings(script.resolve() if script else None))
    routing = read_routing(folder)
    g = growth(result)
    proposal = choose(result, result.step_worst)
    with ReportFolder(out, force) as report_folder:
        if proposal is not None:
            python = python or recorded_python([folder])[0]
            write_proposal(proposal, report_folder, script.resolve() if script else None, tree, python)
            cause = verdict(routing) if routing is not None else None
            if cause:  # a routing cause: the layer and replay first, the dump after
                proposal.notes.insert(0, cause)
        paths, notes = write_report(result, g, proposal, report_folder, dist, routing)
    return MismatchReport(result, g, proposal, paths, tuple(notes), dist, routing)

"""The `weights compare` operation, callable from Python without click.

`compare_weights` compares a run's fingerprints per sync (or a checkpoint against what the engine
holds at one sync), writes the report into `out` when given (one `ReportFolder`, published at
once), and returns a frozen outcome: its verdict an enum, its `to_json()` the `--json` document
(schema in docs/json.md), its `lines()` the terminal text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "rl-msprobe.weights-compare/1"
CHECKPOINT_SCHEMA = "rl-msprobe.weights-checkpoint/1"
SHOW = 40  # finding lines on the terminal


class Parity(str, enum.Enum):
    """The verdict of a weights compare (the document's `verdict`); only EQUAL exits 0."""

    EQUAL = "EQUAL"
    DIFFERENT = "DIFFERENT"
    NOT_COMPARED = "NOT COMPARED"


@dataclass(frozen=True)
class WeightsOutcome:
    """A weights compare: the document (as `weights.compare` / `weights.checkpoint` build it),
    the report files written, and whether it was a checkpoint against the engine."""

    doc: dict[str, Any]
    report: tuple[str, ...] = ()
    checkpoint: bool = False

    @property
    def verdict(self) -> Parity:
        return Parity(self.doc["verdict"])

    @property
    def ok(self) -> bool:
        return self.verdict is Parity.EQUAL

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": CHECKPOINT_SCHEMA if self.checkpoint else SCHEMA, **self.doc}
        return {**doc, "report": list(self.report)} if self.report else doc

    def lines(self) -> list[str]:
        if self.checkpoint:
            from rl_msprobe.weights.checkpoint import summary_lines as checkpoint_lines

            return checkpoint_lines(self.doc)
        from rl_msprobe.weights.report import summary_lines

        lines = summary_lines(self.doc)  # type: ignore[arg-type]  # the document compare_run built
        out = lines[:-1][:SHOW]
        if len(lines) - 1 > SHOW:
            out.append(f"... {len(lines) - 1 - SHOW} more lines (--out DIR writes them all)")
        return [*out, *(f"wrote {path}" for path in self.report), lines[-1]]


def compare_weights(
    folder: Path,
    out: Path | None = None,
    force: bool = False,
    checkpoint: Path | None = None,
    sync: int | None = None,
) -> WeightsOutcome:
    """FOLDER (<dump-dir>/weights): what the actor sent, each engine rank received and holds, per
    sync; with `checkpoint`, that model folder against what the engine holds at `sync`."""
    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.weights.records import read_run

    run = read_run(folder)
    if checkpoint is not None:
        return _against_checkpoint(run, checkpoint, sync, out, force)
    from rl_msprobe.weights.compare import compare_run
    from rl_msprobe.weights.report import write_report

    doc = compare_run(run)
    if out is None:
        return WeightsOutcome(dict(doc))
    with ReportFolder(out, force) as report_folder:
        written = write_report(doc, report_folder)
    return WeightsOutcome(dict(doc), tuple(written))


def _against_checkpoint(
    run: Any, checkpoint: Path, sync: int | None, out: Path | None, force: bool
) -> WeightsOutcome:
    import json

    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.weights.checkpoint import compare_checkpoint, read_checkpoint, summary_lines

    doc = compare_checkpoint(run, read_checkpoint(checkpoint), sync)
    doc["checkpoint"] = str(checkpoint)
    if out is None:
        return WeightsOutcome(doc, checkpoint=True)
    lines = summary_lines(doc)
    with ReportFolder(out, force) as report_folder:
        report_folder.claim(["checkpoint.json", "checkpoint.md"])
        written = [
            report_folder.write("checkpoint.json", json.dumps(doc, indent=1) + "\n"),
            report_folder.write(
                "checkpoint.md",
                "# Checkpoint against the engine\n\n" + "\n".join(f"- {x}" for x in lines) + "\n",
            ),
        ]
    return WeightsOutcome(doc, tuple(str(p) for p in written), checkpoint=True)

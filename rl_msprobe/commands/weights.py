"""`rl-msprobe weights compare DIR`: thin click layer over rl_msprobe.weights.

Exit codes like `dumps compare`: 0 EQUAL, 1 DIFFERENT or NOT COMPARED, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option

SHOW = 40  # finding lines on the terminal


_MODEL_DIR = click.Path(file_okay=False, path_type=Path)


@click.group()
def weights() -> None:
    """Weight parity after every sync (the verl-weights patch set's fingerprints)."""


@weights.command()
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write weights.md, weights.html, weights.json here.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace files in --out that rl-msprobe did not write (or that were edited).",
)
@click.option(
    "--checkpoint",
    type=_MODEL_DIR,
    help="A model folder (safetensors): compare it with what the engine holds at --sync instead.",
)
@click.option(
    "--sync",
    type=click.IntRange(1),
    default=None,
    help="With --checkpoint: the sync whose resident fingerprints are compared (default: the first).",
)
@json_option
@handles_user_errors
def compare(
    folder: Path, out: Path | None, force: bool, checkpoint: Path | None, sync: int | None, as_json: bool
) -> None:
    """Compare what the actor sent, what each engine rank received and what it holds, per sync.

    FOLDER is <dump-dir>/weights of a run prepared with --mode weights (or --weights). Per
    tensor: equal, differs (beyond what the dtypes allow) or missing; stage `received` (differs
    from what was sent: the transfer) or `resident` (what the engine holds or its loader wrote
    differs from what it received). Exit 0 EQUAL, 1 DIFFERENT or NOT COMPARED.
    """
    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.weights.compare import EQUAL, compare_run
    from rl_msprobe.weights.records import read_run
    from rl_msprobe.weights.report import summary_lines, write_report

    if checkpoint is not None:
        _against_checkpoint(folder, checkpoint, sync, out, force, as_json)
    doc = compare_run(read_run(folder))
    if out is not None:
        with ReportFolder(out, force) as report_folder:
            doc["report"] = write_report(doc, report_folder)
    if as_json:
        emit_json(doc)
    else:
        lines = summary_lines(doc)
        for line in lines[:-1][:SHOW]:
            click.echo(line)
        if len(lines) - 1 > SHOW:
            click.echo(f"... {len(lines) - 1 - SHOW} more lines (--out DIR writes them all)")
        for path in doc.get("report", []):
            click.echo(f"wrote {path}")
        click.echo(lines[-1])
    sys.exit(0 if doc["verdict"] == EQUAL else 1)


def _against_checkpoint(
    folder: Path, checkpoint: Path, sync: int | None, out: Path | None, force: bool, as_json: bool
) -> None:
    """`weights compare FOLDER --checkpoint CKPT`: exit 0 EQUAL, 1 otherwise, 2 bad input."""
    import json

    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.weights.checkpoint import compare_checkpoint, read_checkpoint, summary_lines
    from rl_msprobe.weights.compare import EQUAL
    from rl_msprobe.weights.records import read_run

    doc = compare_checkpoint(read_run(folder), read_checkpoint(checkpoint), sync)
    doc["checkpoint"] = str(checkpoint)
    lines = summary_lines(doc)
    if out is not None:
        with ReportFolder(out, force) as report_folder:
            report_folder.claim(["checkpoint.json", "checkpoint.md"])
            written = [
                report_folder.write("checkpoint.json", json.dumps(doc, indent=1) + "\n"),
                report_folder.write(
                    "checkpoint.md",
                    "# Checkpoint against the engine\n\n" + "\n".join(f"- {x}" for x in lines) + "\n",
                ),
            ]
        doc["report"] = [str(p) for p in written]
    if as_json:
        emit_json(doc)
    else:
        for line in lines:
            click.echo(line)
    sys.exit(0 if doc["verdict"] == EQUAL else 1)

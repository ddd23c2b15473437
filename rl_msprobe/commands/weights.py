"""`rl-msprobe weights compare DIR`: thin click layer over rl_msprobe.weights.

Exit codes like `dumps compare`: 0 EQUAL, 1 DIFFERENT or NOT COMPARED, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option

SHOW = 40  # finding lines on the terminal


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
    "--force", is_flag=True, help="Replace files in --out that rl-msprobe did not write (or that were edited)."
)
@json_option
@handles_user_errors
def compare(folder: Path, out: Path | None, force: bool, as_json: bool) -> None:
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

"""`rl-msprobe mismatch report`: thin click layer over rl_msprobe.triage.

Exit codes: 0 report written, 1 no request with response tokens found, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option


@click.group()
def mismatch() -> None:
    """Rollout vs training log-prob gap from a `prepare --mode triage` run (no msprobe, no dumps)."""


@mismatch.command()
@click.argument("folder", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Report folder (default: FOLDER/report).")
@click.option(
    "--script",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The job's launch script: a reproduction script for the proposed consistency dump is derived from it.",
)
@click.option(
    "--tree", metavar="T", help="The verl tree the proposed prepare command names (path or release:verl==V)."
)
@click.option(
    "--python",
    "python",
    metavar="PY",
    help="The interpreter that runs verl (the proposed prepare command names it; default: the one "
    "`prepare --python` recorded above FOLDER, if any).",
)
@click.option(
    "--keep", type=click.IntRange(1, 1000), default=10, show_default=True, help="Worst requests listed."
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace files in --out that rl-msprobe did not write (or that were edited).",
)
@json_option
@handles_user_errors
def report(as_json: bool, **params: Any) -> None:
    """Stream FOLDER's <pid>/triage.jsonl lines into report.md / report.html / PNGs / summary.json.

    Per step: mean, p99 and max of |Δ log p| and |Δp| (|Δp| is verl's training/rollout_probs_diff_*),
    growth over steps, the gap by response position and by token id, the worst requests and their
    positions, and the next step: a one-prompt data file and a ready `prepare --mode consistency` command.
    """
    from rl_msprobe.triage.api import mismatch_report

    result = mismatch_report(**params)
    if as_json:
        emit_json(result.to_json())
    else:
        for line in result.lines():
            click.echo(line)
    sys.exit(0 if result.ok else 1)

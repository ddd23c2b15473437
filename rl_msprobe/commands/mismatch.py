"""`rl-msprobe mismatch report`: thin click layer over rl_msprobe.triage.

Exit codes: 0 report written, 1 no request with response tokens found, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
def report(
    folder: Path,
    out: Path | None,
    script: Path | None,
    tree: str | None,
    python: str | None,
    keep: int,
    force: bool,
    as_json: bool,
) -> None:
    """Stream FOLDER's <pid>/triage.jsonl lines into report.md / report.html / PNGs / summary.json.

    Per step: mean, p99 and max of |Δ log p| and |Δp| (|Δp| is verl's training/rollout_probs_diff_*),
    growth over steps, the gap by response position and by token id, the worst requests and their
    positions, and the next step: a one-prompt data file and a ready `prepare --mode consistency` command.
    """
    from rl_msprobe.dumps.compare import recorded_python
    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.triage.propose import choose, growth, write_proposal
    from rl_msprobe.triage.report import fmt, write_report
    from rl_msprobe.triage.stream import read_triage

    out = (out or (folder if folder.is_dir() else folder.parent) / "report").resolve()
    result = read_triage(folder, keep=keep)
    g = growth(result)
    proposal = choose(result, result.step_worst)
    with ReportFolder(out, force) as report_folder:
        if proposal is not None:
            python = python or recorded_python([folder])[0]
            write_proposal(proposal, report_folder, script.resolve() if script else None, tree, python)
        paths, notes = write_report(result, g, proposal, report_folder)
    if as_json:
        from rl_msprobe.triage.report import summary_json

        emit_json({**summary_json(result, g, proposal, paths), "notes": notes})
    else:
        click.echo(
            f"{result.requests} request(s), {len(result.steps)} step(s) from {len(result.files)} file(s)"
        )
        for s in result.step_list():
            d, lp = s.gaps.get("dp"), s.gaps.get("dlogp")
            if d and lp:
                click.echo(
                    f"  step {s.step}: mean |Δp| {fmt(d.mean())}  max {fmt(d.peak)}   "
                    f"mean |Δ log p| {fmt(lp.mean())}  p99 {fmt(lp.quantile(0.99))}  max {fmt(lp.peak)}"
                )
        if result.error_count or result.bad_count:
            click.echo(
                f"{result.error_count} error line(s), {result.bad_count} unreadable line(s): see the report"
            )
        if proposal is not None:
            click.echo(f"next: dump step {proposal.step} ({proposal.why})")
            for cmd in proposal.commands:
                click.echo(f"  {cmd}")
        for note in notes:
            click.echo(f"note: {note}")
        click.echo(f"report: {paths['md']}\n        {paths['html']}")
    sys.exit(0 if proposal is not None and proposal.request is not None else 1)

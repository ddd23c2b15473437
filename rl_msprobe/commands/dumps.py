"""`rl-msprobe dumps check | correlate | compare | positions`: thin click layer over rl_msprobe.dumps.

Exit codes: 0 fine (layout complete / pairs found / consistent), 1 problems found, 2 bad input.
Library imports stay inside the functions so `rl-msprobe --help` stays light.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from rl_msprobe.commands.common import F, emit_json, handles_user_errors, json_option
from rl_msprobe.planner import registry

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

    from rl_msprobe.dumps.compare import PairResult
    from rl_msprobe.dumps.correlate import Correlation

_dir = click.Path(exists=True, file_okay=False, path_type=Path)
SHOW = 40  # lines per list on the terminal


def jobs_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--jobs",
        "-j",
        type=click.IntRange(1, 64),
        default=None,
        help=f"{what} (default: cores/2, at most 4).",
    )


_dir_or_file = click.Path(exists=True, path_type=Path)


@click.group()
def dumps() -> None:
    """Check, correlate and compare collected msprobe dumps (after the run)."""


@dumps.command()
@click.argument("dirs", nargs=-1, required=True, type=_dir)
@click.option(
    "--mode",
    type=click.Choice(registry.dump_modes()),
    help="Layout to check against (default: detected from what is there).",
)
@jobs_option("Processes parsing dump.json")
@json_option
@handles_user_errors
def check(dirs: tuple[Path, ...], mode: str | None, jobs: int | None, as_json: bool) -> None:
    """Check the dump layout under DIRS (consistency: the rollout and the training dump folders).

    training: {save_path}/step_{G}/{stage}/step0/rank{R}/dump.json; inference:
    [{pid}/]step{N}/rank{R}/dump.json; consistency: both sides plus dispatch_log.jsonl and
    update_actor_log.jsonl. Reports missing steps, ranks and stages, and empty or unparsable
    dump.json. Exit 0 complete, 1 problems found.
    """
    from rl_msprobe.dumps.compare import default_jobs
    from rl_msprobe.dumps.layout import check_layout
    from rl_msprobe.errors import UserError

    if len(dirs) > 2:
        raise UserError("dumps check takes one folder, or two for consistency (rollout and training).")
    report = check_layout(list(dirs), mode, jobs or default_jobs())
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(f"mode: {report.mode} ({report.dumps} dump.json)")
        for group, c in report.counts.items():
            click.echo(
                f"  {group}: {c['dumps']} dumps, steps {c['step_range'][0]}..{c['step_range'][1]} "
                f"({c['steps']}), {', '.join(c['ranks'])}"
            )
        for name, paths in report.logs.items():
            click.echo(f"  {name}: {len(paths)} file(s)")
        for p in report.problems:
            click.echo(f"problem: {p['where']}: {p['what']}. Fix: {p['fix']}.")
        click.echo("layout complete" if report.ok else f"{len(report.problems)} problem(s) found")
    sys.exit(0 if report.ok else 1)


@dumps.command()
@click.argument("rollout_dir", type=_dir)
@click.argument("train_dir", type=_dir)
@json_option
@handles_user_errors
def correlate(rollout_dir: Path, train_dir: Path, as_json: bool) -> None:
    """Pair one-request rollout prefill steps with the training micro-batches of the same request.

    Reads every {pid}/dispatch_log.jsonl under ROLLOUT_DIR and {pid}/update_actor_log.jsonl under
    TRAIN_DIR (streamed), strips vLLM's -<8 hex> id suffix, and explains every line it skips.
    Exit 0 pairs found, 1 none found or a dump / log line is missing.
    """
    from rl_msprobe.dumps.correlate import correlate as run

    result = run(rollout_dir, train_dir)
    if as_json:
        emit_json(result.to_json())
    else:
        for p in result.pairs[:SHOW]:
            peers = "".join(f" + TP peer pid {s.pid} step{s.step} rank{s.rank}" for s in p.peers)
            click.echo(
                f"pair {p.request_id}: rollout pid {p.rollout.pid} step{p.rollout.step} rank{p.rollout.rank}{peers}"
                f"  <->  train pid {p.train.pid} step{p.train.step} rank{p.train.rank}"
            )
        if len(result.pairs) > SHOW:
            click.echo(f"... {len(result.pairs) - SHOW} more pairs (--json lists all)")
        for u in result.unmatched[:SHOW]:
            click.echo(f"unmatched ({u.side}) {u.request_id or '-'}: {u.why}")
        if len(result.unmatched) > SHOW:
            click.echo(f"... {len(result.unmatched) - SHOW} more unmatched (--json lists all)")
        for label, lines in (("used lines", result.used_lines()), ("skipped lines", result.skipped_lines())):
            click.echo(f"{label}: " + (", ".join(f"{k} {v}" for k, v in sorted(lines.items())) or "none"))
        click.echo(
            "pairs per rank: "
            + (", ".join(f"{k} {v}" for k, v in sorted(result.per_rank().items())) or "none")
        )
        click.echo(f"{len(result.pairs)} pair(s), {len(result.unmatched)} unmatched")
    sys.exit(0 if result.pairs and not _hard_problems(result) else 1)


def _hard_problems(result: Correlation) -> bool:
    return any(u.why.startswith("missing dump") or ": not a JSON" in u.why for u in result.unmatched)


def _running_verdict(tally: dict[str, int]) -> str | None:
    """The verdict so far for the progress bar: `DIVERGENT so far (3 consistent, 1 divergent)`."""
    if not tally:
        return None
    word = (
        "DIVERGENT"
        if tally.get("divergent")
        else "NOT COMPARED"
        if tally.get("failed") or tally.get("not compared")
        else "CONSISTENT"
    )
    return f"{word} so far ({', '.join(f'{n} {k}' for k, n in sorted(tally.items()))})"


def _warm_report_imports() -> None:
    """Import the report's plotting (matplotlib, seconds) in a thread while msprobe compares:
    this process only waits on its workers meanwhile."""
    import threading

    def warm() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 - the report imports it again and says what is wrong
            pass

    threading.Thread(target=warm, name="warm-report", daemon=True).start()


@dumps.command()
@click.argument("rollout", type=_dir_or_file)
@click.argument("train", type=_dir_or_file)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder for msprobe output and the report.",
)
@click.option(
    "--train-backend",
    type=click.Choice(["fsdp", "megatron"]),
    default="fsdp",
    show_default=True,
    help="The training backend of the actor dump (msprobe maps its module names by it).",
)
@click.option(
    "--backend", "old_backend", type=click.Choice(["fsdp", "megatron"]), hidden=True
)  # old spelling
@jobs_option("msprobe workers (each imports msprobe once and compares pair after pair)")
@click.option(
    "--limit", type=click.IntRange(1), default=None, help="Compare only the first N pairs (log order)."
)
@click.option(
    "--train-step",
    "train_steps",
    type=click.IntRange(0),
    multiple=True,
    help="Compare only the pairs of this training dump step (msprobe's step of the actor dump; repeat "
    "for several), e.g. a clean step apart from a faulty one.",
)
@click.option(
    "--python",
    "python",
    metavar="PY",
    help="Interpreter that runs msprobe (the training one; may be `docker exec -i NAME python3`). "
    "Default: the one `prepare --python` recorded, else this one.",
)
@click.option(
    "--min-coverage",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="Share of the rollout's modules msprobe must match to training ones; below it a pair is "
    "NOT COMPARED (default 0.5).",
)
@click.option("--timeout", type=click.FloatRange(1), default=None, help="Seconds per pair (default: none).")
@click.option("--per-process", is_flag=True, hidden=True, help="One msprobe process per pair (benchmarks).")
@click.option("--force", is_flag=True, help="Replace report files in --out that rl-msprobe did not write.")
@json_option
@handles_user_errors
def compare(
    rollout: Path,
    train: Path,
    out: Path,
    train_backend: str,
    old_backend: str | None,
    jobs: int | None,
    limit: int | None,
    train_steps: tuple[int, ...],
    python: str | None,
    min_coverage: float | None,
    timeout: float | None,
    per_process: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Run msprobe's consistency compare for every pair and write report.md / report.html.

    With logs (ROLLOUT and TRAIN are the two dump_path folders) the pairs come from `correlate`;
    without logs, two plain dump folders (or two dump.json files) are compared one to one.
    Exit 0 consistent, 1 divergence found, a compare failed or NOT COMPARED (msprobe matched no
    rows, or too few of the rollout's modules), 2 bad input.
    """
    from rl_msprobe.dumps.compare import (
        MIN_COVERAGE,
        CompareRun,
        check_out_dir,
        compare_pairs,
        default_jobs,
        recorded_python,
        verdict,
    )
    from rl_msprobe.dumps.pairs import select_pairs
    from rl_msprobe.dumps.report import REPORT_FILES, dtype_line, pair_lines, write_report
    from rl_msprobe.report_folder import ReportFolder

    backend = old_backend or train_backend  # --backend means the rollout engine elsewhere
    out = check_out_dir(out)
    with ReportFolder(out, force) as folder:  # a user's report.md in the way: refused before msprobe runs
        folder.claim(REPORT_FILES)
    selection = select_pairs(rollout, train, train_steps, limit)
    pairs = selection.pairs
    if len(pairs) < selection.total and not as_json:
        click.echo(f"comparing the first {limit} of {selection.total} pairs (--limit)", err=True)
    run = CompareRun(out=out, backend=backend, correlation=selection.correlation)
    jobs = jobs or default_jobs()
    if python is None:
        python, record = recorded_python([rollout, train])
        if python and not as_json:
            click.echo(f"msprobe runs in {python} (recorded by prepare in {record})", err=True)
    roots = (train.resolve() if train.is_dir() else None, rollout.resolve() if rollout.is_dir() else None)
    _warm_report_imports()

    def compare_all(on_done: Callable[[PairResult], None] | None = None) -> list[PairResult]:
        return compare_pairs(
            pairs,
            out,
            backend,
            jobs,
            on_done,
            python=python,
            per_process=per_process,
            roots=roots,
            min_coverage=MIN_COVERAGE if min_coverage is None else min_coverage,
            timeout=timeout,
        )

    if as_json:
        run.results = compare_all()
    else:
        what = "msprobe process(es) per pair" if per_process else "msprobe worker(s)"
        click.echo(f"{len(pairs)} pair(s), {jobs} {what} -> {out}", err=True)
        tally: dict[str, int] = {}

        progress: ProgressBar[PairResult] = click.progressbar(
            length=len(pairs),
            label="msprobe compare",
            file=sys.stderr,
            show_pos=True,
            item_show_func=lambda _x: _running_verdict(tally),
        )
        with progress as bar:

            def done(r: PairResult) -> None:
                tally[r.status] = tally.get(r.status, 0) + 1
                bar.update(1, r)

            run.results = compare_all(done)
    paths = write_report(run, force)
    if as_json:
        emit_json(run.to_json())
    else:
        for line in pair_lines(run):
            click.echo(line)
        click.echo(dtype_line(run))
        if run.no_plot:
            click.echo(f"no plot: {run.no_plot}")
        click.echo(verdict(run))
        click.echo(f"report: {paths['md']}\n        {paths['html']}")
    sys.exit(0 if run.consistent else 1)


@dumps.command()
@click.argument("rollout", type=_dir)
@click.argument("train", type=_dir)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Folder for the report.")
@click.option(
    "--request",
    "requests",
    multiple=True,
    help="Compare only this request id (repeat for several; default: every recorded request).",
)
@click.option(
    "--triage",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Triage's folder (verl-triage): the log-prob gap per response position under each map.",
)
@click.option(
    "--python", "python", metavar="PY", help="Interpreter that reads tensor files when torch is not here."
)
@click.option("--force", is_flag=True, help="Replace report files in --out that rl-msprobe did not write.")
@json_option
@handles_user_errors
def positions(
    rollout: Path,
    train: Path,
    out: Path,
    requests: tuple[str, ...],
    triage: Path | None,
    python: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Whole-response consistency: every position of each request, prefill and decode steps.

    ROLLOUT: the rollout dump_path (dispatch logs and every step's dump); TRAIN: the actor's dump_path,
    with the per-token records of DUMP_POSITIONS=1. The verdict names the first position and, there,
    the first divergent module. Exit 0 consistent, 1 divergent or NOT COMPARED, 2 bad input.
    """
    import shlex
    import tempfile
    import time

    from rl_msprobe.dumps.position_report import write_job
    from rl_msprobe.dumps.whole_response import compare_job, sizes, summary

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rl-msprobe-positions-") as work:
        wanted = set(requests) if requests else None
        results = compare_job(rollout, train, Path(work), shlex.split(python) if python else None, wanted)
    seconds = time.monotonic() - started
    paths = write_job(results, out, force, triage)
    status, verdict = summary(results)
    if as_json:
        emit_json(
            {
                "status": status,
                "verdict": verdict,
                "seconds": round(seconds, 3),
                "bytes": sizes(rollout, train),
                "requests": [r.to_json() for r in results],
                "report": {k: str(v) for k, v in paths.items()},
            }
        )
    else:
        for r in results:
            click.echo(f"{r.request_id}: {r.verdict()}")
        click.echo(verdict)
        click.echo(f"report: {paths['md']}")
    sys.exit(0 if status == "consistent" else 1)

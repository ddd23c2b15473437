"""`rl-msprobe dumps check | correlate | compare | positions | zoom`: thin click layer over rl_msprobe.dumps.

Exit codes: 0 fine (layout complete / pairs found / consistent), 1 problems found, 2 bad input.
Library imports stay inside the functions so `rl-msprobe --help` stays light.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rl_msprobe import mode_table as registry
from rl_msprobe.commands.common import F, emit_json, emit_outcome, handles_user_errors, json_option

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

    from rl_msprobe.dumps.compare import PairResult

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
    from rl_msprobe.dumps.api import check_dumps

    report = check_dumps(list(dirs), mode, jobs)
    if as_json:
        emit_json(report.to_json())
    else:
        for line in report.lines():
            click.echo(line)
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
        for line in result.lines(SHOW):
            click.echo(line)
    sys.exit(0 if result.ok else 1)


def running_verdict(tally: dict[str, int]) -> str | None:
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


@dumps.command()
@click.argument("rollout", type=_dir_or_file)
@click.argument("train", type=_dir_or_file, required=False)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder for msprobe output and the report.",
)
@click.option(
    "--train-backend",
    "backend",
    type=click.Choice(["fsdp", "megatron"]),
    default="fsdp",
    show_default=True,
    help="The training backend of the actor dump (msprobe maps its module names by it).",
)
@click.option(
    "--backend", "old_backend", type=click.Choice(["fsdp", "megatron"]), hidden=True
)  # old spelling: --backend means the rollout engine elsewhere
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
def compare(as_json: bool, old_backend: str | None, **params: Any) -> None:
    """The consistency verdict: the whole response from per-token records, msprobe's prompt compare beside.

    Where the folders (or their parent) hold per-token records (RL_MSPROBE_RECORD_DIR,
    docs/records.md), every position of every recorded request is judged first, as `dumps
    positions` does (positions.md); msprobe's compare of the prompt runs beside it when both
    folders hold msprobe dumps, its line marked "prompt only". TRAIN may be left out for records.
    With logs (ROLLOUT and TRAIN are the two dump_path folders) the pairs come from `correlate`;
    without logs, two plain dump folders (or two dump.json files) are compared one to one.
    Exit 0 consistent, 1 divergence found, a compare failed or NOT COMPARED (msprobe matched no
    rows, or too few of the rollout's modules), 2 bad input.
    """
    from rl_msprobe.dumps.api import CompareOptions, compare_dumps

    params["backend"] = old_backend or params["backend"]
    if as_json:
        outcome = compare_dumps(CompareOptions(**params))
        emit_json(outcome.to_json())
    else:
        outcome = compare_dumps(CompareOptions(**params), say=_say, watch=_progress)
        for line in outcome.lines():
            click.echo(line)
    sys.exit(0 if outcome.ok else 1)


def _say(text: str) -> None:
    click.echo(text, err=True)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[PairResult], None]]:
    """A progress bar on stderr over `total` pairs, showing the verdict so far."""
    tally: dict[str, int] = {}
    progress: ProgressBar[PairResult] = click.progressbar(
        length=total,
        label="msprobe compare",
        file=sys.stderr,
        show_pos=True,
        item_show_func=lambda _x: running_verdict(tally),
    )
    with progress as bar:

        def done(r: PairResult) -> None:
            tally[r.status] = tally.get(r.status, 0) + 1
            bar.update(1, r)

        yield done


@dumps.command()
@click.argument("rollout", type=_dir)
@click.argument("train", type=_dir, required=False)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Folder for the report.")
@click.option(
    "--estimate-bytes",
    type=click.IntRange(1),
    default=None,
    help="The plan's estimate of the records' bytes (both sides): the report gives measured / estimate "
    "(default: plan.json in the records root, when there is one).",
)
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
def positions(as_json: bool, **params: Any) -> None:
    """Whole-response consistency: every position of each request, prefill and decode steps.

    Per-token records on both sides (docs/records.md): ROLLOUT is the records root
    (RL_MSPROBE_RECORD_DIR) or its parent, or ROLLOUT and TRAIN are its rollout/ and train/ folders.
    Otherwise ROLLOUT: the rollout dump_path (dispatch logs and every step's dump); TRAIN: the actor's
    dump_path, with the per-token records of DUMP_POSITIONS=1. The verdict names the first position
    and, there, the first divergent module. Exit 0 consistent, 1 divergent or NOT COMPARED, 2 bad input.
    """
    from rl_msprobe.dumps.api import compare_positions

    emit_outcome(compare_positions(**params), as_json)


@dumps.command()
@click.argument("dump", type=_dir)
@click.option(
    "--out",
    "out",
    type=click.Path(path_type=Path),
    default=None,
    help="msprobe's compare goes here (default DUMP/zoom).",
)
@click.option(
    "--python",
    "python",
    metavar="PY",
    help="The interpreter with msprobe (default: the one `prepare` recorded).",
)
@json_option
@handles_user_errors
def zoom(dump: Path, out: Path | None, python: str | None, as_json: bool) -> None:
    """The operator a zoom names: msprobe's compare of the two dumps `prepare --zoom` planned.

    DUMP: the zoom's dump folder (actor/ and generate/ below it). msprobe compares the training
    dump against the rollout's by API name; the first API call whose output differs while its input
    agrees is where the difference starts. Exit 0 when one is named, 1 when none, 2 bad input."""
    from rl_msprobe.dumps.zoom_operator import zoom_compare

    emit_outcome(zoom_compare(dump, out or dump / "zoom", python), as_json)

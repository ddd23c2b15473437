"""The `dumps compare` and `dumps positions` operations, callable from Python without click.

Each returns a frozen outcome whose verdict is an enum (never a message to match), whose
`to_json()` is the command's `--json` document (schemas in docs/json.md) and whose `lines()` are
its terminal text. The command only parses options, calls one of these and prints the outcome.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_msprobe.dumps.compare import CompareRun, PairResult
    from rl_msprobe.dumps.layout import LayoutReport
    from rl_msprobe.dumps.record_compare import RecordJob
    from rl_msprobe.dumps.whole_response import RequestResult

COMPARE_SCHEMA = "rl-msprobe.dumps-compare/1"
POSITIONS_SCHEMA = "rl-msprobe.dumps-positions/1"

Say = Callable[[str], None]  # one progress note for the user (stderr on the terminal)
# the progress of N pairs: a context that hands out the callback called as each pair is done
Watch = Callable[[int], AbstractContextManager[Callable[["PairResult"], None]]]


def check_dumps(dirs: list[Path], mode: str | None = None, jobs: int | None = None) -> LayoutReport:
    """The dump layout under one folder (training, inference) or two (consistency: rollout and
    training), checked against `mode` (default: detected); `jobs` processes parse dump.json."""
    from rl_msprobe.dumps.compare import default_jobs
    from rl_msprobe.dumps.layout import check_layout
    from rl_msprobe.errors import UserError

    if len(dirs) > 2:
        raise UserError("dumps check takes one folder, or two for consistency (rollout and training).")
    return check_layout(list(dirs), mode, jobs or default_jobs())


class Verdict(str, enum.Enum):
    """What a compare of dumps found; only CONSISTENT exits 0."""

    CONSISTENT = "consistent"
    DIVERGENT = "divergent"
    NOT_COMPARED = "not compared"  # too little matched to judge, or a compare failed
    NO_PAIRS = "no pairs"


@dataclass(frozen=True)
class CompareOptions:
    """Every choice of `dumps compare` (defaults as the command's)."""

    rollout: Path
    train: Path | None  # None: the records under `rollout` only (no msprobe compare)
    out: Path
    backend: str = "fsdp"
    jobs: int | None = None  # default: cores/2, at most 4
    limit: int | None = None
    train_steps: tuple[int, ...] = ()
    python: str | None = None  # default: the one `prepare --python` recorded, else this one
    min_coverage: float | None = None  # default MIN_COVERAGE
    timeout: float | None = None
    per_process: bool = False
    force: bool = False


@dataclass(frozen=True)
class CompareOutcome:
    """A finished `dumps compare`: the run (every pair's result) and the report written."""

    run: CompareRun | None  # msprobe's compare of the prompt (None: no msprobe dumps, records only)
    report: dict[str, Path]
    verdict: Verdict
    whole: PositionsOutcome | None = None  # the whole response from the per-token records, when there are any

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.CONSISTENT

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"schema": COMPARE_SCHEMA}
        if self.run is not None:
            doc.update(self.run.to_json())
        if self.whole is not None:
            doc["status"] = self.verdict.value
            doc["whole_response"] = self.whole.to_json()
            doc["prompt_only"] = self.run is not None
        return doc

    def lines(self) -> list[str]:
        from rl_msprobe.dumps.compare import verdict
        from rl_msprobe.dumps.report import dtype_line, pair_lines

        out: list[str] = []
        if self.whole is not None:
            out += [f"whole response (per-token records): {line}" for line in self.whole.lines()]
        if self.run is not None:
            out += [*pair_lines(self.run), dtype_line(self.run)]
            if self.run.no_plot:
                out.append(f"no plot: {self.run.no_plot}")
            out += [
                f"prompt only: {verdict(self.run)}",
                f"report: {self.report['md']}\n        {self.report['html']}",
            ]
            if self.whole is None:
                out.append(
                    "(msprobe compares the prompt's forward; the response positions are compared from per-token "
                    "records: RL_MSPROBE_RECORD_DIR, docs/records.md)"
                )
        return out


def compare_verdict(run: CompareRun) -> Verdict:
    """The run's verdict as `dumps.compare.verdict` words it (its first word)."""
    if not run.results:
        return Verdict.NO_PAIRS
    if run.consistent:
        return Verdict.CONSISTENT
    if any(r.status == "divergent" for r in run.results):
        return Verdict.DIVERGENT
    return Verdict.NOT_COMPARED


def compare_dumps(
    options: CompareOptions, say: Say | None = None, watch: Watch | None = None
) -> CompareOutcome:
    """msprobe's consistency compare of every pair, then report.md / report.html in options.out.

    A report file in the way that rl-msprobe did not write is refused before msprobe runs. `say`
    gets the notes worth telling (which pairs, which interpreter), `watch` the progress per pair.
    """
    from rl_msprobe.dumps import records
    from rl_msprobe.dumps.compare import (
        MIN_COVERAGE,
        CompareRun,
        check_out_dir,
        compare_pairs,
        default_jobs,
        recorded_python,
    )
    from rl_msprobe.dumps.pairs import select_pairs
    from rl_msprobe.dumps.report import REPORT_FILES, write_report
    from rl_msprobe.errors import UserError
    from rl_msprobe.report_folder import ReportFolder

    o, tell = options, say or (lambda _text: None)
    given = [o.rollout] if o.train is None else [o.rollout, o.train]
    found = records.find(given + [p.parent for p in given if p.is_dir()])
    whole = None
    if found is not None:  # the front door: the whole response from the records first
        tell(f"per-token records: {', '.join(str(v) for v in found.values())}")
        whole = compare_positions(o.rollout, o.train, o.out, force=o.force, folders=found)
    if o.train is None or (whole is not None and not _has_msprobe_dumps(o.rollout, o.train)):
        if whole is None:
            raise UserError(
                f"{o.rollout}: no per-token records here (DIR/rollout/{{pid}}/rec*.json); pass the rollout and "
                "the training dump folders for msprobe's compare."
            )
        return CompareOutcome(None, whole.report, whole.verdict, whole)
    out = check_out_dir(o.out)
    with ReportFolder(out, o.force) as folder:  # a user's report.md in the way: refused before msprobe runs
        folder.claim(REPORT_FILES)
    selection = select_pairs(o.rollout, o.train, o.train_steps, o.limit)
    if len(selection.pairs) < selection.total:
        tell(f"comparing the first {o.limit} of {selection.total} pairs (--limit)")
    run = CompareRun(out=out, backend=o.backend, correlation=selection.correlation)
    jobs, python = o.jobs or default_jobs(), o.python
    if python is None:
        python, record = recorded_python([o.rollout, o.train])
        if python:
            tell(f"msprobe runs in {python} (recorded by prepare in {record})")
    roots = (
        o.train.resolve() if o.train.is_dir() else None,
        o.rollout.resolve() if o.rollout.is_dir() else None,
    )
    _warm_report_imports()

    def compare_all(on_done: Callable[[PairResult], None] | None = None) -> list[PairResult]:
        return compare_pairs(
            selection.pairs,
            out,
            o.backend,
            jobs,
            on_done,
            python=python,
            per_process=o.per_process,
            roots=roots,
            min_coverage=MIN_COVERAGE if o.min_coverage is None else o.min_coverage,
            timeout=o.timeout,
        )

    if watch is None:
        run.results = compare_all()
    else:
        what = "msprobe process(es) per pair" if o.per_process else "msprobe worker(s)"
        tell(f"{len(selection.pairs)} pair(s), {jobs} {what} -> {out}")
        with watch(len(selection.pairs)) as done:
            run.results = compare_all(done)
    report = write_report(run, o.force)
    prompt = compare_verdict(run)
    if whole is None:
        return CompareOutcome(run, report, prompt)
    both = (whole.verdict, prompt)
    if Verdict.DIVERGENT in both:
        combined = Verdict.DIVERGENT
    elif both == (Verdict.CONSISTENT, Verdict.CONSISTENT):
        combined = Verdict.CONSISTENT
    else:
        combined = Verdict.NOT_COMPARED
    return CompareOutcome(run, {**whole.report, **report}, combined, whole)


def _has_msprobe_dumps(rollout: Path, train: Path) -> bool:
    """Whether both folders hold msprobe dumps (dump.json) to compare the prompt with."""
    from rl_msprobe.dumps.layout import DUMP_FILE, walk_files

    return all(next(walk_files(p, {DUMP_FILE}), None) is not None for p in (rollout, train))


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


@dataclass(frozen=True)
class PositionsOutcome:
    """A finished `dumps positions`: every request's result, the job's verdict and the report."""

    requests: tuple[RequestResult, ...]
    verdict: Verdict
    summary: str  # the one-line verdict: DIVERGENT names the first position and module
    seconds: float
    bytes: dict[str, int]
    report: dict[str, Path]
    records: RecordJob | None = None  # what was read, when both sides were per-token records
    estimate: int | None = None  # the plan's estimate of the records' bytes (--estimate-bytes, plan.json)

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.CONSISTENT

    @property
    def ratio(self) -> float | None:
        """Measured record bytes over the plan's estimate."""
        return sum(self.bytes.values()) / self.estimate if self.estimate else None

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "schema": POSITIONS_SCHEMA,
            "status": self.verdict.value,
            "verdict": self.summary,
            "source": "records" if self.records is not None else "msprobe",
            "seconds": round(self.seconds, 3),
            "bytes": self.bytes,
            "requests": [r.to_json() for r in self.requests],
            "report": {k: str(v) for k, v in self.report.items()},
        }
        if self.records is not None:
            doc["records"] = self.records.to_json()
            doc["estimate_bytes"] = self.estimate
            doc["measured_over_estimate"] = None if self.ratio is None else round(self.ratio, 4)
        return doc

    def lines(self) -> list[str]:
        out = [f"{r.request_id}: {r.verdict()}" for r in self.requests]
        if self.records is not None:
            out += self.records.notes()
            size = ", ".join(f"{side} {n:,} bytes" for side, n in self.bytes.items())
            ratio = (
                f" ({self.ratio:.2f}x the plan's estimate of {self.estimate:,})"
                if self.ratio is not None
                else ""
            )
            out.append(f"records: {size}{ratio}; read and compared in {self.seconds:.2f} s")
        return [*out, self.summary, f"report: {self.report['md']}"]


def compare_positions(
    rollout: Path,
    train: Path | None,
    out: Path,
    requests: tuple[str, ...] = (),
    triage: Path | None = None,
    python: str | None = None,
    force: bool = False,
    estimate_bytes: int | None = None,
    folders: dict[str, Path] | None = None,
) -> PositionsOutcome:
    """Whole-response consistency of every recorded request (or of `requests`), report in `out`.

    Per-token records on both sides (docs/records.md) when ROLLOUT / TRAIN hold them (the records
    root, its parent, or the two side folders; FOLDERS: already found): record against record;
    else msprobe's rollout dumps against the trainer's DUMP_POSITIONS records. `python`: the
    interpreter (a command line) that reads tensor files when torch is not here; `triage`: triage's
    folder, for the log-prob gap under each map; `estimate_bytes`: the plan's estimate of the
    records' size (default: `plan.json` beside the records, when the planner wrote one)."""
    import shlex
    import tempfile

    from rl_msprobe.dumps import records
    from rl_msprobe.dumps.position_report import write_job
    from rl_msprobe.dumps.whole_response import compare_job, sizes, summary
    from rl_msprobe.errors import UserError

    started = time.monotonic()
    found = folders or records.find([rollout] if train is None else [rollout, train])
    if found is not None:
        return _record_positions(found, out, requests, triage, force, estimate_bytes, started)
    if train is None:
        raise UserError(
            f"{rollout}: no per-token records (DIR/rollout/{{pid}}/rec*.json, DIR/train/{{pid}}/rec*.json); pass "
            "the records root (RL_MSPROBE_RECORD_DIR), or the rollout and the actor dump folders."
        )
    with tempfile.TemporaryDirectory(prefix="rl-msprobe-positions-") as work:
        wanted = set(requests) if requests else None
        results = compare_job(rollout, train, Path(work), shlex.split(python) if python else None, wanted)
    seconds = time.monotonic() - started
    paths = write_job(results, out, force, triage)
    status, line = summary(results)
    return PositionsOutcome(tuple(results), Verdict(status), line, seconds, sizes(rollout, train), paths)


def _record_positions(
    folders: dict[str, Path],
    out: Path,
    requests: tuple[str, ...],
    triage: Path | None,
    force: bool,
    estimate: int | None,
    started: float,
) -> PositionsOutcome:
    """`compare_positions` on per-token records (record_compare)."""
    from rl_msprobe.dumps import record_compare, records
    from rl_msprobe.dumps.position_report import write_job
    from rl_msprobe.dumps.whole_response import summary

    job = record_compare.compare_job(folders, set(requests) if requests else None)
    seconds = time.monotonic() - started
    notes = job.notes()
    if estimate is None:
        estimate = records.plan_estimate(folders)
    paths = write_job(list(job.results), out, force, triage, notes)
    status, line = summary(list(job.results))
    if not job.results:
        status, line = "not compared", "NOT COMPARED: no request was recorded on both sides"
    one_sided = [n for n in notes if n.startswith("recorded on")]
    if one_sided:
        line += f"; {'; '.join(one_sided)}"
    return PositionsOutcome(
        tuple(job.results), Verdict(status), line, seconds, dict(job.sizes), paths, job, estimate
    )

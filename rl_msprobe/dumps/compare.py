"""Run msprobe's own consistency compare for each pair, `jobs` at a time.

Each pair is one `msprobe compare -tp <train dump.json> -gp <rollout dump.json>
--consistent_check --backend fsdp|megatron -o <out>/pairs/<nnn>_<id>` — the documented CLI,
given the copies `inputs` prepares where msprobe could not match the dumps as they are, and
run by `runners` (one long-lived msprobe worker per job, in the training interpreter with
`--python`). rl-msprobe never computes a metric itself; it reads the CSV msprobe writes
(see `summary`). It writes only into a `pairs/` folder it creates itself.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe import bounded, publishing
from rl_msprobe.dumps import inputs
from rl_msprobe.dumps.correlate import Correlation, Pair, Side
from rl_msprobe.dumps.layout import DUMP_FILE, find_dumps
from rl_msprobe.dumps.runners import ProcessRunner, WorkerRunner, interpreter
from rl_msprobe.dumps.summary import PairSummary, Row, summarize, with_tp_findings
from rl_msprobe.errors import UserError

BACKENDS = ("fsdp", "megatron")
# below this share of the rollout's modules matched to training ones, a pair is NOT COMPARED
MIN_COVERAGE = 0.5
# msprobe refuses paths outside this alphabet (its file checks)
_SAFE_PATH = re.compile(r"^[a-zA-Z0-9_.:/-]+$")


@dataclass
class PairResult:
    number: int
    pair: Pair
    out_dir: Path
    csv: Path | None = None
    summary: PairSummary | None = None
    error: str | None = None  # msprobe failed: the tail of its log
    seconds: float = 0.0
    min_coverage: float = MIN_COVERAGE
    notes: list[str] = field(default_factory=list)  # what the inputs given to msprobe changed

    @property
    def status(self) -> str:
        """failed | divergent | not compared (too few rows matched to say) | consistent."""
        s = self.summary
        if s is None:
            return "failed"
        if s.input_mismatch:
            return "not compared"  # different inputs: no layer can be judged
        if not s.consistent:
            return "divergent"  # a divergence on matched rows is a finding, whatever the coverage
        if s.matched_rows == 0 or s.coverage < self.min_coverage:
            return "not compared"
        return "consistent"

    @property
    def not_compared_reason(self) -> str | None:
        s = self.summary
        if s is None or self.status != "not compared":
            return None
        if s.input_mismatch:
            return s.input_mismatch
        if s.matched_rows == 0:
            return (
                f"msprobe matched 0 of {len(s.rows)} rows: no training name met a rollout name "
                "(unknown wrapper or naming? the prepared input names are in the pair's inputs/ folder)"
            )
        return (
            f"only {len(s.matched_modules & s.rollout_modules)} of {len(s.rollout_modules)} rollout "
            f"modules matched a training module ({s.coverage:.0%} < {self.min_coverage:.0%})"
        )

    def to_json(self, rows: bool = False) -> dict[str, object]:
        return {
            "number": self.number,
            "status": self.status,
            **self.pair.to_json(),
            "out_dir": str(self.out_dir),
            "csv": str(self.csv) if self.csv else None,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "not_compared": self.not_compared_reason,
            "inputs": self.notes,
            "summary": self.summary.to_json(rows=rows) if self.summary else None,
        }


@dataclass
class CompareRun:
    out: Path
    backend: str
    results: list[PairResult] = field(default_factory=list)
    correlation: Correlation | None = None  # None for a plain folder-to-folder compare
    no_plot: str | None = None  # why the report has no plot (set by report.write_report)

    @property
    def consistent(self) -> bool:
        return bool(self.results) and all(r.status == "consistent" for r in self.results)

    def dtype_pairs(self) -> dict[str, int]:
        """`training -> rollout` dtype differences on matched rows, over all pairs."""
        out: dict[str, int] = {}
        for r in self.results:
            for k, n in (r.summary.dtype_pairs() if r.summary else {}).items():
                out[k] = out.get(k, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def noise_floors(self) -> dict[str, float]:
        """Noise floor by precision over every pair (judge.NOISE_FLOOR as applied)."""
        out: dict[str, float] = {}
        for r in self.results:
            out.update(r.summary.floors() if r.summary else {})
        return out

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "out": str(self.out),
            "backend": self.backend,
            "consistent": self.consistent,
            "verdict": verdict(self),
            "dtypes": self.dtype_pairs(),
            "noise_floor": self.noise_floors(),
            "first_divergences": first_divergences(self),
            "pairs": [r.to_json() for r in self.results],
            "report": {"md": str(self.out / "report.md"), "html": str(self.out / "report.html")},
            "no_plot": self.no_plot,
        }
        if self.correlation is not None:
            doc["unmatched"] = [u.to_json() for u in self.correlation.unmatched]
            doc["skipped_lines"] = self.correlation.skipped_lines()
            doc["used_lines"] = self.correlation.used_lines()
        return doc


def _where(row: Row) -> str:
    return f"{row.module} {row.tensor}".strip()


def first_divergences(run: CompareRun) -> dict[str, list[int]]:
    """`module tensor` of each divergent pair's first divergence -> the pair numbers, most pairs first."""
    out: dict[str, list[int]] = {}
    for r in run.results:
        first = r.summary.first_divergence if r.summary and r.status == "divergent" else None
        if first is not None:
            out.setdefault(_where(first), []).append(r.number)
    return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))


def _floor_text(run: CompareRun) -> str:
    floors = run.noise_floors()
    return ", ".join(f"{k} {100 * v:.3g}%" for k, v in sorted(floors.items())) or "–"


def verdict(run: CompareRun) -> str:
    """One line that cannot call a compare consistent when nothing (or too little) was compared,
    and names every divergent pair's first divergence (rl-msprobe's rule: dumps.judge)."""
    if not run.results:
        return "NO PAIRS: nothing was compared"
    n = len(run.results)
    failed = [r for r in run.results if r.status == "failed"]
    diverging = [r for r in run.results if r.status == "divergent"]
    unmatched = [r for r in run.results if r.status == "not compared"]
    if run.consistent:
        summaries = [r.summary for r in run.results if r.summary is not None]  # all: none failed
        rows = sum(s.matched_rows for s in summaries)
        modules = sum(len(s.judgements) for s in summaries)
        return (
            f"CONSISTENT: {n} pair(s), {rows} matched row(s), {modules} module output(s) judged; none exceeds "
            f"its input's error and the noise floor ({_floor_text(run)})"
        )
    parts = []
    if diverging:
        firsts = first_divergences(run)
        where = "; ".join(
            f"{w} (layer {_layer(run, nums[0])}) in {'all ' if len(nums) == len(diverging) else ''}"
            f"{len(nums)} pair(s){'' if len(nums) == len(diverging) else ' #' + ','.join(map(str, nums))}"
            for w, nums in firsts.items()
        )
        agree = "pairs agree" if len(firsts) == 1 else f"pairs disagree ({len(firsts)} places)"
        parts.append(f"DIVERGENT: {len(diverging)} of {n} pair(s); first divergence {where}; {agree}")
    elif unmatched:
        parts.append(f"NOT COMPARED: {len(unmatched)} of {n} pair(s); {unmatched[0].not_compared_reason}")
    else:
        parts.append("NOT COMPARED")  # only failures: said next
    if diverging and unmatched:
        parts.append(f"{len(unmatched)} pair(s) not compared ({unmatched[0].not_compared_reason})")
    if failed:
        parts.append(f"{len(failed)} of {n} pair(s) failed to compare")
    return "; ".join(parts)


def _layer(run: CompareRun, number: int) -> str:
    r = next(r for r in run.results if r.number == number)
    first = r.summary.first_divergence if r.summary else None
    return "–" if first is None or first.layer is None else str(first.layer)


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:limit].strip("._") or "pair"


def check_out_dir(out: Path) -> Path:
    out = out.resolve()
    if not _SAFE_PATH.match(str(out)):
        raise UserError(
            f"{out}: msprobe only accepts output paths made of letters, digits and _ . : / -. "
            "Choose an --out without spaces or other characters."
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory. Choose another --out.")
    return out


PAIRS = "pairs"
MARKER = ".rl-msprobe-pairs"  # in a pairs/ folder this tool created


def pairs_dir(out: Path) -> Path:
    """A fresh folder to build this run's `<out>/pairs/` in: a temporary sibling (`publishing`), put
    in place as a unit by `publish_pairs` when every pair is done, so an interrupted run leaves the
    earlier pairs as they were. An existing `pairs/` must be one this tool created (its marker
    inside, nothing symlinked, only its own entries); anything else is refused, never deleted."""
    pairs = out / PAIRS
    publishing.recover_folder(pairs)
    if pairs.is_symlink() or (pairs.exists() and not (pairs / MARKER).is_file()):
        raise UserError(
            f"{pairs}: exists and was not created by rl-msprobe dumps compare; it is left alone. "
            "Choose another --out (or move that folder away)."
        )
    if pairs.exists():
        for old in pairs.iterdir():
            if old.name != MARKER and not _ours(old):
                raise UserError(
                    f"{old}: not written by rl-msprobe dumps compare; {pairs} is left alone. "
                    "Choose another --out."
                )
    out.mkdir(parents=True, exist_ok=True)
    staging = publishing.stage_folder(pairs)
    (staging / MARKER).write_text("folders below were written by rl-msprobe dumps compare\n")
    return staging


def publish_pairs(staging: Path, out: Path, results: list[PairResult]) -> None:
    """The run's pairs folder in place as `<out>/pairs/` (one rename), the results' paths with it."""
    final = out / PAIRS
    try:
        publishing.swap_folder(staging, final)
    except OSError as exc:
        raise UserError(
            f"{final}: the pairs folder could not be put in place ({exc.strerror}); the earlier one is as "
            "it was. Free some space and run again."
        ) from None
    for result in results:
        result.out_dir = _moved(result.out_dir, staging, final)
        result.csv = _moved(result.csv, staging, final) if result.csv else None
        if result.error:
            result.error = result.error.replace(str(staging), str(final))


def _moved(path: Path, staging: Path, final: Path) -> Path:
    try:
        return final / path.relative_to(staging)
    except ValueError:
        return path


_PAIR_DIR = re.compile(r"^\d{3,}_[A-Za-z0-9_.-]*$")
_WORKER_LOG = re.compile(r"^worker\d+\.log$")


def _ours(path: Path) -> bool:
    if path.is_symlink():
        return False
    if path.is_dir():
        return bool(_PAIR_DIR.match(path.name))
    return path.is_file() and bool(_WORKER_LOG.match(path.name))


def compare_args(train: Path, rollout: Path, backend: str, out_dir: Path) -> list[str]:
    return [
        "compare",
        "-tp",
        str(train),
        "-gp",
        str(rollout),
        "--consistent_check",
        "--backend",
        backend,
        "-o",
        str(out_dir),
    ]


def _inside(path: Path, root: Path | None) -> bool:
    return root is None or path == root or root in path.parents


def run_one(
    number: int,
    pair: Pair,
    out: Path,
    backend: str,
    runner: ProcessRunner | WorkerRunner,
    timeout: float | None = None,
    roots: tuple[Path | None, Path | None] = (None, None),
    min_coverage: float = MIN_COVERAGE,
) -> PairResult:
    """One msprobe compare through `runner`; never raises for a pair's own failure. `roots`
    (train, rollout): the folders the dumps must lie under (resolved paths)."""
    out_dir = out / f"{number:03d}_{_slug(pair.request_id)}"  # out: this run's pairs folder
    result = PairResult(number, pair, out_dir, min_coverage=min_coverage)
    dumps = {}
    sides = [("train", pair.train.dump, roots[0])]
    sides += [(f"rollout{i or ''}", s.dump, roots[1]) for i, s in enumerate(pair.rollout_ranks)]
    for side, path, root in sides:
        resolved = Path(path).resolve() if path else None
        if resolved is None or not _inside(resolved, root):
            result.error = f"{side} dump {path!r} is not inside {root}; not read"
            return result
        if not _SAFE_PATH.match(str(resolved)):
            result.error = f"{side} dump path {path!r} has characters msprobe refuses (spaces, +, ...)"
            return result
        dumps[side] = resolved
    out_dir.mkdir(parents=True)
    start = time.monotonic()
    try:
        peers = tuple(dumps[f"rollout{i}"] for i in range(1, len(pair.rollout_ranks)))
        given = inputs.prepare(
            dumps["train"], dumps["rollout"], out_dir / "inputs", backend, peers, runner.python
        )
    except UserError as exc:
        result.error = str(exc)
        return result
    result.notes = given.notes
    log = out_dir / "msprobe.log"
    rc = runner.run(compare_args(given.train, given.rollout, backend, out_dir), log, timeout)
    result.seconds = time.monotonic() - start
    csvs = sorted(out_dir.glob("compare_result_*.csv"))
    if rc != 0 or not csvs:
        tail = [x for x in _log_tail(log).splitlines() if x.strip()][-8:]
        why = "exited 0 but wrote no compare_result CSV (it matched no row?)" if rc == 0 else f"exited {rc}"
        result.error = f"msprobe compare {why} (log: {log}):\n" + "\n".join(tail)
        return result
    result.csv = csvs[-1]
    try:
        result.summary = with_tp_findings(summarize(result.csv), given.disagreements)
    except (OSError, ValueError) as exc:
        result.error = f"could not read {result.csv}: {exc}"
    return result


def compare_pairs(
    pairs: list[Pair],
    out: Path,
    backend: str,
    jobs: int = 1,
    on_done: Callable[[PairResult], None] | None = None,
    *,
    python: str | None = None,
    per_process: bool = False,
    roots: tuple[Path | None, Path | None] = (None, None),
    min_coverage: float = MIN_COVERAGE,
    timeout: float | None = None,
) -> list[PairResult]:
    """Compare every pair, `jobs` at a time (one msprobe worker per job, or a process per pair
    with `per_process`); results in pair order."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: msprobe's consistency compare knows {', '.join(BACKENDS)}.")
    argv = interpreter(python)  # fail early and plainly when msprobe cannot be found
    staging = pairs_dir(out)
    local = threading.local()
    runners: list[ProcessRunner | WorkerRunner] = []
    lock = threading.Lock()

    def runner() -> ProcessRunner | WorkerRunner:
        r = getattr(local, "runner", None)
        if r is None:
            with lock:
                n = len(runners)
                r = ProcessRunner(argv) if per_process else WorkerRunner(argv, staging / f"worker{n}.log")
                runners.append(r)
            local.runner = r
        return r

    def one(i: int, p: Pair) -> PairResult:
        return run_one(i, p, staging, backend, runner(), timeout, roots, min_coverage)

    results: list[PairResult] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(one, i, p) for i, p in enumerate(pairs, 1)]
            for fut in as_completed(futures):
                res = fut.result()
                results.append(res)
                if on_done:
                    on_done(res)
    except BaseException as exc:
        for r in runners:
            r.close()
        publishing.discard_folder(staging)  # the earlier pairs stay as they were
        if isinstance(exc, OSError):
            raise UserError(
                f"{exc.filename or staging}: could not be written ({exc.strerror}); {out / PAIRS} is as it was. "
                "Free some space and run again."
            ) from None
        raise
    for r in runners:
        r.close()
    results.sort(key=lambda r: r.number)
    publish_pairs(staging, out, results)
    return results


# ------------------------------------------------------------------ plain folders (no logs)
def plain_pairs(rollout: Path, train: Path) -> list[Pair]:
    """Pairs for two dump folders without logs: a dump.json each, or the same stepN/rankR below each."""

    def dumps(root: Path) -> dict[str, Path]:
        if root.is_file():
            return {"": root}
        if (root / DUMP_FILE).is_file():
            return {"": root / DUMP_FILE}
        return {str(r.path.parent.relative_to(root)): r.path for r in find_dumps(root)}

    r, t = dumps(rollout), dumps(train)
    if not r or not t:
        empty = rollout if not r else train
        raise UserError(
            f"{empty}: no dump.json found (expected step{{N}}/rank{{R}}/dump.json or a dump.json)."
        )
    if len(r) == 1 and len(t) == 1:
        keys = [(next(iter(r)), next(iter(t)))]
    else:
        common = sorted(set(r) & set(t))
        if not common:
            raise UserError(
                f"{rollout} and {train}: no step{{N}}/rank{{R}} folder in common. "
                "Pass the two dump.json files (or two step/rank folders) to compare one to one."
            )
        keys = [(k, k) for k in common]
    return [
        Pair(
            request_id=rk or tk or "dump",
            rollout=Side(None, None, None, str(r[rk])),
            train=Side(None, None, None, str(t[tk])),
        )
        for rk, tk in keys
    ]


PYTHON_RECORD = "rl-msprobe-python.json"  # {"python": PY}, written by `prepare --python PY`


def recorded_python(roots: list[Path], up: int = 3) -> tuple[str | None, Path | None]:
    """The training interpreter `prepare` recorded next to its configs (the default dump folders
    lie below them): looked up in each root and up to `up` folders above it."""
    import json

    for root in roots:
        folder = root.resolve() if root.is_dir() else root.resolve().parent
        for d in [folder, *folder.parents][: up + 1]:
            record = d / PYTHON_RECORD
            if record.is_file():
                try:
                    text = bounded.read_text(record, "python record `prepare` writes", bounded.CONFIG)
                    python = json.loads(text).get("python")
                except (OSError, ValueError, AttributeError, RecursionError):
                    raise UserError(
                        f"{record}: not the JSON `prepare` writes; delete it or pass --python."
                    ) from None
                if isinstance(python, str) and python.strip():
                    return python, record
    return None, None


def default_jobs() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _log_tail(log: Path, size: int = 64 << 10) -> str:
    """The last SIZE bytes of msprobe's log as text (a log of any length, read within bounds)."""
    try:
        with bounded.open_regular(log, "msprobe log") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            return f.read(size).decode("utf-8", "replace")
    except (OSError, UserError) as exc:
        return f"(the log cannot be read: {exc})"

"""Run msprobe's own consistency compare for each pair, in parallel processes.

Each pair is one `msprobe compare -tp <train dump.json> -gp <rollout dump.json>
--consistent_check --backend fsdp|megatron -o <out>/pairs/<nnn>_<id>` — the documented CLI,
in its own process (msprobe keeps global state and logs to stdout). rl-msprobe never computes
a metric itself; it reads the CSV msprobe writes (see `summary`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe.dumps.correlate import Correlation, Pair, Side
from rl_msprobe.dumps.layout import DUMP_FILE, find_dumps
from rl_msprobe.dumps.summary import PairSummary, summarize
from rl_msprobe.errors import UserError

BACKENDS = ("fsdp", "megatron")
# msprobe refuses paths outside this alphabet (its file checks)
_SAFE_PATH = re.compile(r"^[a-zA-Z0-9_.:/-]+$")


def msprobe_command() -> list[str]:
    """How to start msprobe: this interpreter's module if importable, else `msprobe` on PATH."""
    if importlib.util.find_spec("msprobe") is not None:
        return [sys.executable, "-m", "msprobe.msprobe"]
    exe = shutil.which("msprobe")
    if exe:
        return [exe]
    raise UserError(
        "msprobe is not installed in this Python. Install it with `pip install mindstudio-probe` "
        "(or `pip install 'rl-msprobe[msprobe]'`) and run again."
    )


@dataclass
class PairResult:
    number: int
    pair: Pair
    out_dir: Path
    csv: Path | None = None
    summary: PairSummary | None = None
    error: str | None = None  # msprobe failed: the tail of its log
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.summary is None:
            return "failed"
        return "consistent" if self.summary.consistent else "divergent"

    def to_json(self, rows: bool = False) -> dict:
        return {
            "number": self.number,
            "status": self.status,
            **self.pair.to_json(),
            "out_dir": str(self.out_dir),
            "csv": str(self.csv) if self.csv else None,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "summary": self.summary.to_json(rows=rows) if self.summary else None,
        }


@dataclass
class CompareRun:
    out: Path
    backend: str
    results: list[PairResult] = field(default_factory=list)
    correlation: Correlation | None = None  # None for a plain folder-to-folder compare

    @property
    def consistent(self) -> bool:
        return bool(self.results) and all(r.status == "consistent" for r in self.results)

    def to_json(self) -> dict:
        doc = {
            "out": str(self.out),
            "backend": self.backend,
            "consistent": self.consistent,
            "pairs": [r.to_json() for r in self.results],
            "report": {"md": str(self.out / "report.md"), "html": str(self.out / "report.html")},
        }
        if self.correlation is not None:
            doc["unmatched"] = [u.to_json() for u in self.correlation.unmatched]
            doc["skipped_lines"] = dict(self.correlation.skipped)
        return doc


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


def run_one(number: int, pair: Pair, out: Path, backend: str, timeout: float | None = None) -> PairResult:
    """One msprobe compare in a child process; never raises for msprobe's own failures."""
    out_dir = out / "pairs" / f"{number:03d}_{_slug(pair.request_id)}"
    result = PairResult(number, pair, out_dir)
    for side, path in (("train", pair.train.dump), ("rollout", pair.rollout.dump)):
        if not path or not _SAFE_PATH.match(str(Path(path).resolve())):
            result.error = f"{side} dump path {path!r} has characters msprobe refuses (spaces, +, ...)"
            return result
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cmd = msprobe_command() + [
        "compare",
        "-tp",
        str(Path(pair.train.dump).resolve()),
        "-gp",
        str(Path(pair.rollout.dump).resolve()),
        "--consistent_check",
        "--backend",
        backend,
        "-o",
        str(out_dir),
    ]
    start = time.monotonic()
    log = out_dir / "msprobe.log"
    try:
        with open(log, "wb") as f:
            f.write((" ".join(cmd) + "\n").encode())
            f.flush()
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result.seconds = time.monotonic() - start
    csvs = sorted(out_dir.glob("compare_result_*.csv"))
    if rc != 0 or not csvs:
        tail = log.read_text(errors="replace").splitlines()[-8:]
        result.error = f"msprobe compare exited {rc}; see {log}:\n" + "\n".join(tail)
        return result
    result.csv = csvs[-1]
    try:
        result.summary = summarize(result.csv)
    except (OSError, ValueError) as exc:
        result.error = f"could not read {result.csv}: {exc}"
    return result


def compare_pairs(
    pairs: list[Pair],
    out: Path,
    backend: str,
    jobs: int = 1,
    on_done: Callable[[PairResult], None] | None = None,
) -> list[PairResult]:
    """Compare every pair (at most `jobs` msprobe processes at once); results in pair order."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: msprobe's consistency compare knows {', '.join(BACKENDS)}.")
    msprobe_command()  # fail early and plainly when msprobe is missing
    out.mkdir(parents=True, exist_ok=True)
    results: list[PairResult] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_one, i, p, out, backend) for i, p in enumerate(pairs, 1)]
        for fut in as_completed(futures):
            res = fut.result()
            results.append(res)
            if on_done:
                on_done(res)
    return sorted(results, key=lambda r: r.number)


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


def default_jobs() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))

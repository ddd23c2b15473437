"""Where `dump.json` files live, and a check of the layout each collection mode produces.

msprobe writes `{dump_path}/step{N}/rank{R}/dump.json` (`proc{pid}` instead of `rank{R}` when
torch.distributed is not initialised; a bare `rank` on some single-card runs). The rl-msprobe
helpers move `dump_path` into a `{pid}` sub-folder, and verl's own training profiler adds
`step_{G}/{stage}/` in front. This module knows those shapes and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

DUMP_FILE = "dump.json"
DISPATCH_LOG = "dispatch_log.jsonl"
TRAIN_LOG = "update_actor_log.jsonl"
TRAINING_STAGES = ("actor_compute_log_prob", "ref_compute_log_prob", "actor_update")

_STEP = re.compile(r"^step(\d+)$")
_GLOBAL_STEP = re.compile(r"^step_(\d+)$")
_RANK = re.compile(r"^(?:rank(\d*)|proc(\d+))$")
_PID = re.compile(r"^\d+$")


def load_json(path: Path) -> object:
    """Parse a JSON file; UserError (exit 2) naming the file when it cannot be read or parsed,
    including JSON nested too deeply for Python's parser (RecursionError). NaN / Infinity stay
    numbers: in a dump's statistics they are msprobe's record of a tensor that held them, a finding
    the compare reports, not bad input (unlike a weights fingerprint or a token count)."""
    from rl_msprobe import bounded
    from rl_msprobe.errors import UserError

    try:
        return json.loads(bounded.read_bytes(path, "msprobe dump.json", bounded.DUMP_JSON))
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to read; not an msprobe dump.json.") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: cannot read it as JSON ({exc}).") from None


@dataclass(frozen=True, order=True)
class DumpRef:
    """One `dump.json` and what its path says about it (None where the level is absent)."""

    path: Path
    step: int
    rank: int | None = None  # rank{R}; None for proc{pid} and a bare `rank`
    proc: int | None = None  # proc{pid}
    pid: int | None = None  # the {pid} level the rl-msprobe helpers add
    global_step: int | None = None  # verl profiler step_{G}
    stage: str | None = None  # verl profiler stage

    @property
    def rank_label(self) -> str:
        if self.proc is not None:
            return f"proc{self.proc}"
        return "rank" if self.rank is None else f"rank{self.rank}"


def parse_dump_path(root: Path, path: Path) -> DumpRef | None:
    """Read step / rank / pid / stage from a dump.json path below `root`; None if it fits no layout."""
    parts = path.relative_to(root).parts
    if len(parts) < 3 or parts[-1] != DUMP_FILE:
        return None
    rank_m, step_m = _RANK.match(parts[-2]), _STEP.match(parts[-3])
    if not rank_m or not step_m:
        return None
    where = str(path.parent)
    rank = _number(rank_m.group(1), MAX_RANK, where, "rank") if rank_m.group(1) else None
    proc = _number(rank_m.group(2), MAX_PID, where, "proc (pid)") if rank_m.group(2) else None
    prefix = parts[:-3]
    pid = global_step = stage = None
    global_m = _GLOBAL_STEP.match(prefix[-2]) if len(prefix) >= 2 else None
    if global_m:
        global_step = _number(global_m.group(1), MAX_STEP, where, "global step")
        stage = prefix[-1]
        prefix = prefix[:-2]
    if prefix and _PID.match(prefix[-1]):
        pid = _number(prefix[-1], MAX_PID, where, "pid")
    return DumpRef(
        path, _number(step_m.group(1), MAX_STEP, where, "step"), rank, proc, pid, global_step, stage
    )


# what a real run produces, with room: beyond these a folder name is a stray, refused by name
MAX_STEP = 10_000_000
MAX_RANK = 1_000_000
MAX_PID = 1 << 22  # Linux's largest pid_max


def _number(digits: str, limit: int, where: str, what: str) -> int:
    from rl_msprobe import bounded

    if len(digits) > 20:  # int() of thousands of digits is refused by Python itself
        return bounded.bounded_int(10**21, limit, where, what)
    return bounded.bounded_int(int(digits), limit, where, what)


def walk_files(root: Path, names: set[str], max_depth: int = 8) -> Iterator[Path]:
    """Files named one of `names` below root (depth-limited, sorted, symlinked dirs not followed).
    Folders are walked as text: only the files found become Paths (a run has 100,000s of folders).
    A folder that cannot be listed (permissions) is a UserError naming it, never skipped."""
    stack: list[tuple[str, int]] = [(str(root), 0)]
    while stack:
        d, depth = stack.pop()
        try:
            with os.scandir(d) as it:  # the deepest level: only the files looked for (a folder of 100,000s)
                entries = list(it) if depth < max_depth else [e for e in it if e.name in names]
            entries.sort(key=_entry_name, reverse=True)
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone meanwhile, or root is a file: the callers say what they found
        except OSError as exc:  # never a count that silently leaves a folder of the run out
            raise UserError(
                f"{d}: cannot be listed ({exc.strerror}); make it readable (chmod u+rx) or move it out of "
                f"{root}, then run again (rl-msprobe reads every folder of a run, or says which it cannot)."
            ) from None
        for e in entries:
            if e.name in names:
                if not e.is_dir(follow_symlinks=False):
                    yield Path(e.path)
            elif depth < max_depth and e.name != "dump_tensor_data" and e.is_dir(follow_symlinks=False):
                stack.append((e.path, depth + 1))


def _entry_name(entry: os.DirEntry[str]) -> str:
    return entry.name


def find_dumps(root: Path) -> list[DumpRef]:
    refs = [parse_dump_path(root, p) for p in walk_files(root, {DUMP_FILE})]
    return sorted(r for r in refs if r is not None)


class DumpIndex:
    """Finds the dump of (pid, step, rank) under one side's root, listing each base folder once.

    Accepts `{root}/{pid}/step{N}/rank{R}`, `{root}/step{N}/rank{R}` and `proc{pid}` for `rank{R}`.
    """

    def __init__(self, root: Path):
        self.root = root
        self._base = str(root)
        self._listing: dict[str, dict[str, bool]] = {}
        self._bases: dict[int | None, tuple[tuple[str, bool], ...]] = {}  # pid -> (folder, is a link)
        self._real: str | None = None

    def _entries(self, d: str, keep: bool) -> dict[str, bool]:
        """The names in base folder D and whether each is a symlink (one scandir, no stat per name);
        KEEP: remember it (asked once per pair)."""
        entries = self._listing.get(d)
        if entries is None:
            try:
                with os.scandir(d) as it:
                    entries = {e.name: e.is_symlink() for e in it}
            except OSError:
                entries = {}
            if keep:
                self._listing[d] = entries
        return entries

    def find(self, pid: int | None, step: int, rank: int | None) -> str | None:
        """The dump of (pid, step, rank), inside the root, or None. The ids are validated integers
        (see correlate), so they cannot climb out of the root themselves; a symlink on the way is
        resolved and must stay inside. Paths are joined as text, the base folders listed once,
        the rest is an lstat or two: a log of a million lines asks a million times."""
        step_dir, sep = f"step{step}", os.sep
        bases = self._bases.get(pid)
        if bases is None:
            root = self._base
            bases = self._bases[pid] = (
                ((root, False),)
                if pid is None
                else ((f"{root}{sep}{pid}", self._entries(root, True).get(str(pid), False)), (root, False))
            )
        for base, base_link in bases:
            step_link = (self._listing.get(base) or self._entries(base, True)).get(step_dir)
            if step_link is None:
                continue
            step_path = f"{base}{sep}{step_dir}"
            for rank_dir in (f"rank{rank}", f"proc{pid}", "rank"):
                path = f"{step_path}{sep}{rank_dir}{sep}{DUMP_FILE}"
                try:
                    folder, info = os.lstat(f"{step_path}{sep}{rank_dir}"), os.lstat(path)
                except OSError:
                    continue
                links = base_link or step_link or stat.S_ISLNK(folder.st_mode) or stat.S_ISLNK(info.st_mode)
                if not links:
                    if stat.S_ISREG(info.st_mode):
                        return path
                elif os.path.isfile(path) and self._inside(path):
                    return path
        return None

    def _inside(self, path: str) -> bool:
        """False for a dump reached through a symlink that leads out of the root."""
        if self._real is None:
            self._real = os.path.realpath(self.root)
        return os.path.realpath(path).startswith(self._real + os.sep)

    def expected(self, pid: object, step: object, rank: object) -> str:
        """The path the helpers would have written (for messages about a missing dump)."""
        return os.path.join(self._base, str(pid), f"step{step}", f"rank{rank}", DUMP_FILE)


# ------------------------------------------------------------------------------------ check
class GroupCount(TypedDict):
    """What one group of dumps (a pid, a training step's stage) holds."""

    dumps: int
    steps: int
    step_range: list[int]  # [lowest, highest]
    ranks: list[str]  # rank labels, in rank order


@dataclass
class LayoutReport:
    mode: str
    roots: list[str]
    dumps: int = 0
    counts: dict[str, GroupCount] = field(default_factory=dict)
    logs: dict[str, list[str]] = field(default_factory=dict)  # log name -> paths
    problems: list[dict[str, str]] = field(default_factory=list)  # {"where", "what", "fix"}

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"schema": "rl-msprobe.dumps-check/1", **asdict(self), "ok": self.ok}

    def lines(self) -> list[str]:
        """The terminal text of `dumps check`: the counts per group and log, then each problem."""
        out = [f"mode: {self.mode} ({self.dumps} dump.json)"]
        out += [
            f"  {group}: {c['dumps']} dumps, steps {c['step_range'][0]}..{c['step_range'][1]} "
            f"({c['steps']}), {', '.join(c['ranks'])}"
            for group, c in self.counts.items()
        ]
        out += [f"  {name}: {len(paths)} file(s)" for name, paths in self.logs.items()]
        out += [f"problem: {p['where']}: {p['what']}. Fix: {p['fix']}." for p in self.problems]
        return [*out, "layout complete" if self.ok else f"{len(self.problems)} problem(s) found"]


def check_dump_file(path: Path) -> str | None:
    """Why a dump.json is unusable (empty, not JSON, no `data`), or None. Streamed: `data` is
    read a batch of entries at a time and dropped once checked (by msgspec, which validates the
    JSON without building its values; json where it refuses one), so a dump of a million entries
    costs a batch's memory, not the document's. A NaN / Infinity statistic (msprobe writes NaN for a
    tensor that holds one) parses as a number: it is a finding for `dumps compare`, not a broken
    file, unlike a fingerprint or a token count, where no real run writes one. An integer of more
    than 4,300 digits is valid JSON to msgspec, which never converts it, so it passes here (json
    refuses to convert it; `dumps compare`, which reads the values, says so)."""
    from rl_msprobe import bounded
    from rl_msprobe.dumps import jsonl
    from rl_msprobe.errors import UserError

    try:
        # a FIFO, a device or an unreadable file is said as such (by bounded), never "empty"
        if bounded.regular(path, "msprobe dump.json").st_size == 0:
            return "empty file"
        with bounded.open_regular(path, "msprobe dump.json", bounded.DUMP_JSON) as f:
            parser = jsonl.Parser(f, f.read(jsonl.READ), str(path), bounded.DUMP_JSON, whole=True)
            if parser.char() != "{":
                parser.value()
                parser.end()
                return "no top-level `data` (not an msprobe dump.json)"
            parser.i += 1
            head: dict[str, object] = {}
            data = parser.members(head, "data")
            entries = sum(len(b) for b in data.batches(jsonl.SKIP_PAIRS)) if data is not None else None
    except UserError as exc:
        return str(exc)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"unparsable: {exc}"
    except RecursionError:
        return "unparsable: JSON nested too deeply"
    if "data" not in head:
        return "no top-level `data` (not an msprobe dump.json)"
    if not (entries if data is not None else head["data"]):
        return "`data` is empty: nothing was dumped (was debugger.start() reached with the model?)"
    return None


def _check_files(paths: list[Path], jobs: int) -> list[str | None]:
    """check_dump_file for each path; JSON parsing is CPU-bound, so many files go to processes."""
    if jobs <= 1 or len(paths) < 32:
        return [check_dump_file(p) for p in paths]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(check_dump_file, paths, chunksize=max(1, len(paths) // (jobs * 8))))


def detect_mode(roots: list[Path]) -> str:
    """consistency needs a training side: its update-actor log, or a dispatch log with two
    folders given. The vllm-dump patch writes a dispatch log in inference mode too, so that log
    alone means inference."""
    logs = {p.name for r in roots for p in walk_files(r, {DISPATCH_LOG, TRAIN_LOG}, max_depth=3)}
    if TRAIN_LOG in logs or (DISPATCH_LOG in logs and len(roots) > 1):
        return "consistency"
    if any(ref.stage for r in roots for ref in find_dumps(r)[:50]):
        return "training"
    return "inference"


def _group_key(ref: DumpRef, mode: str) -> str:
    if mode == "training" and ref.stage is not None:
        return f"step_{ref.global_step}/{ref.stage}"
    return "" if ref.pid is None else f"pid {ref.pid}"


def _check_side(root: Path, mode: str, report: LayoutReport, label: str, jobs: int = 1) -> None:
    refs = find_dumps(root)
    if not refs:
        report.problems.append(
            {
                "where": str(root),
                "what": f"no {label}dump.json in the layout step{{N}}/rank{{R}}/dump.json",
                "fix": "point at the msprobe dump_path (for training: global_profiler.save_path)",
            }
        )
        return
    report.dumps += len(refs)
    by_group: dict[str, list[DumpRef]] = defaultdict(list)
    for ref in refs:
        by_group[_group_key(ref, mode)].append(ref)
    for ref, why in zip(refs, _check_files([r.path for r in refs], jobs)):
        if why:
            fix = "re-run that step; the dump was cut short"
            if why.startswith(f"{ref.path}: "):  # not a readable regular file (a FIFO, a device, permissions)
                why = why[len(str(ref.path)) + 2 :].split("; ")[0]  # bounded's own fix is said below
                fix = "put the dump.json msprobe wrote there (a readable regular file)"
            report.problems.append({"where": str(ref.path), "what": why, "fix": fix})
    if mode == "training":
        _check_training(root, refs, report)
    all_ranks = {r.rank_label for r in refs if r.proc is None}
    for group, grefs in sorted(by_group.items()):
        steps: dict[int, set[str]] = defaultdict(set)
        for r in grefs:
            steps[r.step].add(r.rank_label)
        ranks_seen = sorted({x for s in steps.values() for x in s}, key=_rank_sort)
        report.counts[f"{label}{group or root.name}"] = {
            "dumps": len(grefs),
            "steps": len(steps),
            "step_range": [min(steps), max(steps)],
            "ranks": ranks_seen,
        }
        where = str(root / group.replace("pid ", "")) if group else str(root)
        if mode != "training":
            gaps = step_gaps(sorted(steps))
            if gaps:
                report.problems.append(
                    {
                        "where": where,
                        "what": f"missing steps {gaps} between step{min(steps)} and step{max(steps)}",
                        "fix": "check the msprobe config `step` list and whether those steps ran",
                    }
                )
        for step, ranks in sorted(steps.items()):
            want = all_ranks if group == "" or mode == "training" else {x for s in steps.values() for x in s}
            missing = sorted((want - ranks) - {"rank"}, key=_rank_sort)
            if missing and not any(x.startswith("proc") for x in ranks):
                report.problems.append(
                    {
                        "where": f"{where}/step{step}",
                        "what": f"missing {', '.join(missing)} (other steps have them)",
                        "fix": "check the msprobe config `rank` list and that every rank reached the dump",
                    }
                )


def _check_training(root: Path, refs: list[DumpRef], report: LayoutReport) -> None:
    stages_by_step: dict[int, set[str]] = defaultdict(set)
    for r in refs:
        if r.stage is None:
            report.problems.append(
                {
                    "where": str(r.path),
                    "what": "not under step_{G}/{stage}/ as verl's precision_debugger profiler writes it",
                    "fix": "point at global_profiler.save_path, or use --mode inference for a plain dump",
                }
            )
            continue
        assert r.global_step is not None, "parse_dump_path reads the stage with its step_{G}"
        stages_by_step[r.global_step].add(r.stage)
        if r.stage not in TRAINING_STAGES:
            report.problems.append(
                {
                    "where": str(r.path),
                    "what": f"unknown stage {r.stage!r}",
                    "fix": f"verl only fires {', '.join(TRAINING_STAGES)}",
                }
            )
    all_stages = set().union(*stages_by_step.values()) if stages_by_step else set()
    for g, stages in sorted(stages_by_step.items()):
        if all_stages - stages:
            report.problems.append(
                {
                    "where": str(root / f"step_{g}"),
                    "what": f"missing stage(s) {', '.join(sorted(all_stages - stages))} (other steps have them)",
                    "fix": "check precision_debugger.stages and that the step finished",
                }
            )


def _rank_sort(label: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", label)
    return (int(digits) if digits else -1, label)


def step_gaps(steps: list[int]) -> str:
    """The missing runs between sorted steps as text ("step3, step5-9"), from the steps present only
    (a stray step number far away costs nothing)."""
    out = []
    for low, high in zip(steps, steps[1:]):
        if high - low == 2:
            out.append(f"step{low + 1}")
        elif high - low > 2:
            out.append(f"step{low + 1}-{high - 1}")
    return ", ".join(out)


def check_layout(roots: list[Path], mode: str | None = None, jobs: int = 1) -> LayoutReport:
    """Check one or two dump roots against the layout of `mode` (detected when None); `jobs`
    processes parse the dump.json files."""
    mode = mode or detect_mode(roots)
    report = LayoutReport(mode=mode, roots=[str(r) for r in roots])
    if mode != "consistency":
        for root in roots:
            _check_side(root, mode, report, "", jobs)
        return report
    found: dict[str, list[Path]] = {
        DISPATCH_LOG: [p for r in roots for p in walk_files(r, {DISPATCH_LOG}, max_depth=3)],
        TRAIN_LOG: [p for r in roots for p in walk_files(r, {TRAIN_LOG}, max_depth=3)],
    }
    report.logs = {k: [str(p) for p in v] for k, v in found.items()}
    sides = {}
    for name, side in ((DISPATCH_LOG, "rollout"), (TRAIN_LOG, "train")):
        if not found[name]:
            report.problems.append(
                {
                    "where": ", ".join(str(r) for r in roots),
                    "what": f"no {name} ({side} side)",
                    "fix": "apply the rl-msprobe consistency patches and run with DUMP_ON=1"
                    if side == "train"
                    else "apply vllm-ascend-dispatch-log / vllm-dump / sglang-dispatch-log so the rollout writes its "
                    "dispatch log",
                }
            )
            continue
        # the side root: the folder holding the {pid} folders with the log
        sides[side] = found[name][0].parent.parent
    for side, root in sides.items():
        _check_side(root, "consistency", report, f"{side}: ", jobs)
    if "rollout" in sides:
        _check_tp_group(sides["rollout"], found[DISPATCH_LOG], report)
    return report


def _first_line(log: Path) -> JsonObject:
    from rl_msprobe import bounded

    try:
        with bounded.open_regular(log, "dispatch log") as f:
            doc = json.loads(next(bounded.lines(f, log, "dispatch log"), b"{}"))
    except (OSError, ValueError, RecursionError, UserError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _check_tp_group(root: Path, logs: list[Path], report: LayoutReport) -> None:
    """The rollout's tensor-parallel ranks belong together: each rank of the group (`tp_size` in
    the dispatch log) has a pid folder with its log, and all of them dumped the same number of
    steps (every TP worker runs every model step)."""
    ranks: dict[int, list[str]] = defaultdict(list)  # rank -> pid folders
    sizes: set[int] = set()
    for log in logs:
        line = _first_line(log)
        rank = line.get("tp_rank", line.get("rank"))
        if isinstance(rank, int) and not isinstance(rank, bool):
            ranks[rank].append(log.parent.name)
        if isinstance(line.get("tp_size"), int):
            sizes.add(line["tp_size"])
    if not ranks or not sizes:
        return  # logs of helpers that do not write tp_size: no TP group to check
    size = max(sizes)
    missing = sorted(set(range(size)) - set(ranks))
    if missing:
        report.problems.append(
            {
                "where": str(root),
                "what": f"missing tensor-parallel rank(s) {', '.join(map(str, missing))} of {size}: no dispatch log "
                f"(present: {', '.join(f'rank {r} pid {p}' for r in sorted(ranks) for p in ranks[r])})",
                "fix": "every TP worker writes its own {pid} folder; copy the missing rank's folder too, or re-run",
            }
        )
    counts: dict[tuple[int, str], int] = {}
    for rank, pids in ranks.items():
        for pid in pids:
            counts[(rank, pid)] = len(find_dumps(root / pid)) if (root / pid).is_dir() else 0
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"rank {r} pid {p}: {n}" for (r, p), n in sorted(counts.items()))
        report.problems.append(
            {
                "where": str(root),
                "what": f"the tensor-parallel ranks dumped different numbers of steps ({shown})",
                "fix": "a TP rank's dumps are incomplete (deleted, or the run was cut short): every TP worker dumps "
                "every model step",
            }
        )

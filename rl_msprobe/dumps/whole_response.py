"""Whole-response consistency over a job's dumps: each training forward over prompt + response
with its request's rollout steps, compared position by position (docs/whole-response.md).

- The training half: the per-token records of the verl engine hook (`DUMP_POSITIONS=1`,
  `{actor dump_path}/positions/{pid}/forward{K}.json`), one per log-prob micro-batch of one
  request, named by its request id.
- The rollout half: the rollout dump helper's dispatch log (`{pid}/dispatch_log.jsonl`, one line
  per dumped model step, `phase` prefill or decode): the request's prefill step, then one decode
  step per generated token, each on every TP rank.
- The two meet on the request id (`correlate.strip_request_id`); `positions.compare_request`
  judges each position (`positions.Result`).

A request is NOT COMPARED, with the reason, when its rollout steps are not one request's (several
requests in one step: `max_num_seqs=1`), when a TP rank's steps are missing, or when its training
record has several requests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe.dumps.correlate import find_logs, read_jsonl, strip_request_id
from rl_msprobe.dumps.layout import DumpIndex
from rl_msprobe.dumps.positions import Loader, Result, compare_request, load_arrays, read_forward, read_step
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

DISPATCH_LOG = "dispatch_log.jsonl"
RECORDS = "positions"


@dataclass
class RolloutRequest:
    """One request's rollout steps on each TP rank, in the order they ran."""

    request_id: str
    # tp rank -> [(phase, tokens, dump.json or None, where in the log)]
    ranks: dict[int, list[tuple[str, int, str | None, str]]] = field(default_factory=dict)
    problem: str | None = None  # why its steps cannot be used

    def steps(self) -> tuple[list[Path], list[list[Path]]]:
        """(the prefill's dump per TP rank, each decode step's dumps per TP rank), lowest rank
        first; UserError naming what is missing."""
        widths = {len(v) for v in self.ranks.values()}
        if len(widths) != 1:
            counts = ", ".join(f"TP rank {r}: {len(v)}" for r, v in sorted(self.ranks.items()))
            raise UserError(
                f"request {self.request_id}: its TP ranks dumped different step counts ({counts})."
            )
        order = [self.ranks[r] for r in sorted(self.ranks)]
        rows: list[list[Path]] = []
        for k in range(widths.pop()):
            row = []
            for rank_steps in order:
                phase, _, dump, where = rank_steps[k]
                if dump is None:
                    raise UserError(
                        f"{where}: the {phase} step's dump.json is missing; re-run the job's dump."
                    )
                row.append(Path(dump))
            rows.append(row)
        first_phase = order[0][0][0]
        if first_phase != "prefill" or any(s[0] != "decode" for s in order[0][1:]):
            phases = " ".join(s[0] for s in order[0][:6])
            raise UserError(
                f"request {self.request_id}: its steps are not one prefill and then decodes ({phases} ...; "
                "chunked prefill or preemption): not comparable position by position."
            )
        return rows[0], rows[1:]


def rollout_requests(root: Path) -> dict[str, RolloutRequest]:
    """Every request of the rollout dispatch logs under ROOT with its steps (module doc)."""
    index = DumpIndex(root)
    bad: list[str] = []
    found: dict[str, RolloutRequest] = {}
    for log in find_logs(root, DISPATCH_LOG):
        for n, line in read_jsonl(log, bad, "requests"):
            where = f"{log}:{n}"
            requests = line.get("requests")
            if not isinstance(requests, list) or not requests:
                continue
            ids = [strip_request_id(str(r.get("request_id"))) for r in requests if isinstance(r, dict)]
            if len(ids) != 1:
                for rid in ids:
                    found.setdefault(
                        rid, RolloutRequest(rid)
                    ).problem = (
                        f"{where}: a step served {len(ids)} requests together (set rollout.max_num_seqs=1)"
                    )
                continue
            request = requests[0]
            rid = ids[0]
            tokens = request.get("tokens")
            tp = line.get("tp_rank")
            tp_rank = tp if isinstance(tp, int) else 0
            pid, step, rank = line.get("pid"), line.get("step"), line.get("rank")
            if not isinstance(step, int) or not isinstance(tokens, int):
                bad.append(f"{where}: no integer step / tokens")
                continue
            dump = index.find(
                pid if isinstance(pid, int) else None, step, rank if isinstance(rank, int) else None
            )
            entry = found.setdefault(rid, RolloutRequest(rid))
            entry.ranks.setdefault(tp_rank, []).append((str(line.get("phase")), tokens, dump, where))
    if bad and not found:
        raise UserError(f"{bad[0]} (and {len(bad) - 1} more)" if len(bad) > 1 else bad[0])
    return found


@dataclass(frozen=True)
class TrainRecord:
    path: Path
    request_ids: tuple[str, ...]
    rank: int | None
    forward: int | None


def train_records(root: Path) -> list[TrainRecord]:
    """The per-token records under ROOT/positions (module doc); UserError when there are none."""
    base = root / RECORDS
    paths = sorted(base.glob("*/forward*.json"), key=_record_order) if base.is_dir() else []
    if not paths:
        raise UserError(
            f"{base}: no per-token records (forward*.json). The training side records them with "
            "DUMP_POSITIONS=1 and the verl-engine patch (prepare --mode consistency writes both); "
            "pass the actor's dump_path folder."
        )
    out = []
    for path in paths:
        head = _head(path)
        ids = head.get("request_ids")
        rank, forward = head.get("rank"), head.get("forward")
        out.append(
            TrainRecord(
                path,
                tuple(strip_request_id(str(x)) for x in ids) if isinstance(ids, list) else (),
                rank if isinstance(rank, int) else None,
                forward if isinstance(forward, int) else None,
            )
        )
    return out


def _record_order(path: Path) -> tuple[str, int, str]:
    """(pid folder, K of forward{K}.json): each process's records in the order it wrote them."""
    digits = path.stem.removeprefix("forward")
    return (path.parent.name, int(digits) if digits.isdigit() else -1, path.name)


def _head(path: Path) -> JsonObject:
    """A record's fields other than `data` (the whole file is read; records are small)."""
    from rl_msprobe.dumps.layout import load_json

    doc = load_json(path)
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a per-token record (a JSON object).")
    return {k: v for k, v in doc.items() if k != "data"}


@dataclass
class RequestResult:
    request_id: str
    train: TrainRecord | None
    result: Result | None = None
    problem: str | None = None  # NOT COMPARED before any position: why
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return self.result.status if self.result is not None else "not compared"

    def verdict(self) -> str:
        return self.result.verdict() if self.result is not None else f"NOT COMPARED: {self.problem}"

    def to_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "train": None
            if self.train is None
            else {"path": str(self.train.path), "rank": self.train.rank, "forward": self.train.forward},
            "status": self.status,
            "verdict": self.verdict(),
            "seconds": round(self.seconds, 3),
            **({"positions": self.result.to_json()} if self.result is not None else {}),
        }


def compare_job(
    rollout_root: Path,
    train_root: Path,
    work: Path,
    python: list[str] | None = None,
    requests: set[str] | None = None,
) -> list[RequestResult]:
    """Every training record (REQUESTS: only those ids) with its rollout steps, judged position by
    position; in the training records' order. WORK: where TP ranks' steps are merged."""
    rollout = rollout_requests(rollout_root)
    load = load_arrays(python)
    out: list[RequestResult] = []
    for n, record in enumerate(train_records(train_root)):
        if requests is not None and not set(record.request_ids) & requests:
            continue
        out.append(_compare_one(record, rollout, work / f"request{n}", python, load))
    if requests is not None and not out:
        raise UserError(
            f"no per-token record of request(s) {', '.join(sorted(requests))} under {train_root}."
        )
    return out


def _compare_one(
    record: TrainRecord,
    rollout: dict[str, RolloutRequest],
    work: Path,
    python: list[str] | None,
    load: Loader,
) -> RequestResult:
    if len(record.request_ids) != 1:
        rid = ",".join(record.request_ids) or "?"
        why = (
            f"{record.path}: the micro-batch held {len(record.request_ids)} requests (set micro batch sizes to 1)"
            if record.request_ids
            else f"{record.path}: no request id (the verl-request-id patch?)"
        )
        return RequestResult(rid, record, problem=why)
    rid = record.request_ids[0]
    found = rollout.get(rid)
    if found is None:
        return RequestResult(rid, record, problem=f"no rollout step of request {rid} in the dispatch logs")
    if found.problem:
        return RequestResult(rid, record, problem=found.problem)
    started = time.monotonic()
    try:
        prefill, decodes = found.steps()
        train = read_forward(record.path)
        first = read_step(prefill, train, work / "prefill", python)
        rest = [read_step(ranks, train, work / f"decode{k}", python) for k, ranks in enumerate(decodes)]
        result = compare_request(first, rest, train, load)
    except UserError as exc:
        return RequestResult(rid, record, problem=str(exc), seconds=time.monotonic() - started)
    return RequestResult(rid, record, result, seconds=time.monotonic() - started)


def summary(results: list[RequestResult]) -> tuple[str, str]:
    """(status, one-line verdict) of a job's requests: DIVERGENT names the first divergent request."""
    if not results:
        return "not compared", "NOT COMPARED: no request"
    bad = [r for r in results if r.status == "divergent"]
    if bad:
        return (
            "divergent",
            f"DIVERGENT ({len(bad)} of {len(results)} request(s)): {bad[0].request_id}: {bad[0].verdict()}",
        )
    odd = [r for r in results if r.status != "consistent"]
    if odd:
        return (
            "not compared",
            f"NOT COMPARED ({len(odd)} of {len(results)} request(s)): {odd[0].request_id}: {odd[0].verdict()}",
        )
    return "consistent", f"CONSISTENT ({len(results)} request(s)): {results[0].verdict()}"


def sizes(rollout_root: Path, train_root: Path) -> dict[str, int]:
    """Bytes on disk: the rollout's dumps and the training side's per-token records."""

    def total(root: Path) -> int:
        """Walked with a stack, not Path.rglob (recursive: 1,100 nested folders end in RecursionError);
        links are not followed, and a folder that cannot be listed is said (layout.walk_files)."""
        found, stack = 0, [str(root)]
        while stack:
            try:
                with os.scandir(stack.pop()) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            found += entry.stat(follow_symlinks=False).st_size
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise UserError(
                    f"{exc.filename}: cannot be listed ({exc.strerror}); make it readable."
                ) from None
        return found

    return {"rollout": total(rollout_root), "train_records": total(train_root / RECORDS)}

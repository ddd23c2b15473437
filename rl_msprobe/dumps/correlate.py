"""The DOMAIN §6 join: which rollout prefill step and which training micro-batch saw one request.

Rollout side: `{rollout}/{pid}/dispatch_log.jsonl`, one line per model step
(`phase`, `step`, `rank`, `tp_rank`, `tp_size`, `requests[{request_id, type, tokens}]`). Only a
`prefill` step with exactly one request, of type `new`, dumps one prompt's prefill alone. With a
tensor-parallel rollout every TP worker (its own pid and rank) logs the same prefill: those are
TP peers, and a pair carries all of them (a missing rank leaves the request unpaired, said why). Training side:
`{train}/{pid}/update_actor_log.jsonl`, one line per micro-batch (`step` = msprobe's
current_iter, `rank`, `request_ids`). vLLM >= 0.14 appends `-<8 hex>` to request ids, and verl's
SGLang PD replica sends `{id}_P` to its prefill server; both sides are stripped before matching.

The logs are streamed line by line. What stays in memory is one small entry per request id
that can still pair (or needs explaining), never one per line: a million decode lines cost
a counter.
"""

from __future__ import annotations

import enum
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, overload

import msgspec

from rl_msprobe import bounded
from rl_msprobe.dumps import jsonl
from rl_msprobe.dumps.layout import DISPATCH_LOG, TRAIN_LOG, DumpIndex, walk_files
from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
# verl's SGLang PD replica sends a request to its prefill server as `{request_id}_P` (and to the
# decode server as `{request_id}_D`, whose passes are decode, not the prefill that pairs): stripped
_DIGITS = re.compile(r"^[0-9]{1,12}$")
# in the ids of a batch, one per line: an id strip_request_id may change (it never misses one)
_SUFFIXED = re.compile(r"-[0-9a-f]{8}\n|_P\n")
# outcomes of lines that *were* used for a pair (the rest are skipped_lines)
SCHEMA = "rl-msprobe.dumps-correlate/1"  # the `dumps correlate --json` document (docs/json.md)
USED = ("rollout: one-request prefill", "rollout: one-request prefill (TP peer rank)", "train: matched")


def strip_request_id(request_id: str) -> str:
    """Drop the `-<8 hex>` suffix vLLM >= 0.14 appends to the request id it was given, and the
    `_P` verl's SGLang PD replica appends for its prefill server."""
    if len(request_id) >= 9 and request_id[-9] == "-":  # the regex only where it can match
        request_id = _VLLM_SUFFIX.sub("", request_id)
    return request_id[:-2] if request_id.endswith("_P") else request_id


@dataclass(frozen=True, slots=True)  # slots: one per pair and TP rank of a long run
class Side:
    """One side's dump of a pair: the validated ids from its log (None: not from a log), and the path."""

    pid: int | None
    rank: int | None
    step: int | None
    dump: str | None

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "rank": self.rank, "step": self.step, "dump": self.dump}


@dataclass(frozen=True, slots=True)
class Pair:
    request_id: str
    rollout: Side  # the lowest TP rank
    train: Side
    peers: tuple[Side, ...] = ()  # the other TP ranks of the same rollout step

    @property
    def rollout_ranks(self) -> tuple[Side, ...]:
        """Every TP rank of the rollout step, lowest first."""
        return (self.rollout, *self.peers)

    def to_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "rollout": self.rollout.to_json(),
            "train": self.train.to_json(),
            "tp_ranks": [s.to_json() for s in self.rollout_ranks],
        }


class Unpaired(str, enum.Enum):
    """Why a request or a log line has no pair: only BAD_LINE and MISSING_DUMP are broken input
    (`dumps correlate` exits 1 on them even when other requests paired)."""

    UNPAIRED = "unpaired"  # the logs say why it cannot pair (batched, chunked, no partner...)
    MISSING_DUMP = "missing dump"  # paired by the logs, but a side's dump.json is not there
    BAD_LINE = "bad line"  # a log line that is not a JSON object


@dataclass(frozen=True, slots=True)  # slots: a million of them is the result of a long log
class Unmatched:
    request_id: str | None
    side: str  # rollout | train
    why: str
    kind: Unpaired = Unpaired.UNPAIRED

    def to_json(self) -> dict[str, object]:
        return {"request_id": self.request_id, "side": self.side, "why": self.why}


@dataclass
class Correlation:
    pairs: list[Pair] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> log lines not considered for a pair
    logs: dict[str, list[str]] = field(default_factory=dict)

    def skipped_lines(self) -> dict[str, int]:
        """Log lines not used for a pair, by why (the `skipped` counter holds every outcome)."""
        return {k: v for k, v in self.skipped.items() if k not in USED}

    def used_lines(self) -> dict[str, int]:
        return {k: v for k, v in self.skipped.items() if k in USED}

    def per_rank(self) -> dict[str, int]:
        """Pairs per rank of each side: `rollout rank0`, `rollout rank1` (TP peers), `train rank0`, ...
        (in the order first seen; counted by rank, each key written once)."""
        seen: Counter[tuple[str, int | None]] = Counter(
            key
            for p in self.pairs
            for key in (
                ("rollout", p.rollout.rank),
                *(("rollout", s.rank) for s in p.peers),
                ("train", p.train.rank),
            )
        )
        return {f"{side} rank{rank}": n for (side, rank), n in seen.items()}

    @property
    def ok(self) -> bool:
        """Pairs found, and no log line or dump missing or broken (`dumps correlate` exits 0)."""
        return bool(self.pairs) and all(u.kind is Unpaired.UNPAIRED for u in self.unmatched)

    def lines(self, show: int = 40) -> list[str]:
        """The terminal text of `dumps correlate`: the first `show` pairs and unmatched, then counts."""
        out = []
        for p in self.pairs[:show]:
            peers = "".join(f" + TP peer pid {s.pid} step{s.step} rank{s.rank}" for s in p.peers)
            out.append(
                f"pair {p.request_id}: rollout pid {p.rollout.pid} step{p.rollout.step} rank{p.rollout.rank}{peers}"
                f"  <->  train pid {p.train.pid} step{p.train.step} rank{p.train.rank}"
            )
        if len(self.pairs) > show:
            out.append(f"... {len(self.pairs) - show} more pairs (--json lists all)")
        out += [f"unmatched ({u.side}) {u.request_id or '-'}: {u.why}" for u in self.unmatched[:show]]
        if len(self.unmatched) > show:
            out.append(f"... {len(self.unmatched) - show} more unmatched (--json lists all)")
        for label, lines in (("used lines", self.used_lines()), ("skipped lines", self.skipped_lines())):
            out.append(f"{label}: " + (", ".join(f"{k} {v}" for k, v in sorted(lines.items())) or "none"))
        ranks = ", ".join(f"{k} {v}" for k, v in sorted(self.per_rank().items())) or "none"
        return [
            *out,
            f"pairs per rank: {ranks}",
            f"{len(self.pairs)} pair(s), {len(self.unmatched)} unmatched",
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "schema": SCHEMA,
            "pairs": [p.to_json() for p in self.pairs],
            "per_rank": self.per_rank(),
            "unmatched": [u.to_json() for u in self.unmatched],
            "skipped_lines": self.skipped_lines(),
            "used_lines": self.used_lines(),
            "logs": self.logs,
        }


def find_logs(root: Path, name: str) -> list[Path]:
    """`{root}/{pid}/{name}` (or `{root}/{name}`), sorted; UserError if there is none."""
    if not root.is_dir():
        raise UserError(f"{root}: not a directory. Pass the dump_path folder of that side.")
    logs = sorted(walk_files(root, {name}, max_depth=1))  # {root}/{pid}/{name}: not into step folders
    if not logs:
        raise UserError(
            f"{root}: no {name} in it or in its {{pid}} sub-folders. "
            + (
                "The rollout writes it when the dispatch-log patch is applied (vllm-ascend-dispatch-log / vllm-dump / "
                "sglang-dispatch-log)."
                if name == DISPATCH_LOG
                else "The training helper writes it when verl is patched (verl-consistency) and DUMP_ON=1."
            )
        )
    return logs


def read_jsonl(path: Path, bad: list[str], stream: str | None = None) -> Iterator[tuple[int, JsonObject]]:
    """(line number, object) for each JSON object line; bad lines go to `bad` as 'file:line: why'
    (a line cut short by a killed process is expected); JSON nested too deeply is bad input.
    A line longer than one read has its STREAM list as a `jsonl.Streamed` (see jsonl.py). A line
    is decoded by msgspec (in C, from the bytes); one it refuses (NaN, an integer of more than 64
    bits, JSON that is not) by json, which decides what it is."""
    loads, decode = json.loads, msgspec.json.decode
    with bounded.open_regular(path, "JSONL log") as f:
        for n, line in jsonl.read(f, path, stream or "", need=("phase",)):
            if isinstance(line, dict):
                yield n, line
                continue
            if line is None:
                bad.append(f"{path}:{n}: not a JSON line (cut short by a killed process?)")
                continue
            try:
                obj = decode(line)
            except (msgspec.MsgspecError, RecursionError):
                obj = None
            try:
                if obj is None:
                    obj = loads(line.decode("utf-8"))  # str: loads skips guessing the encoding
            except RecursionError:
                raise UserError(
                    f"{path}:{n}: JSON nested too deeply; not a line rl-msprobe's helpers write. "
                    "Remove that line (or point at the folder the run wrote)."
                ) from None
            except ValueError:
                if line.strip():
                    bad.append(f"{path}:{n}: not a JSON line (cut short by a killed process?)")
                continue
            if type(obj) is dict:
                yield n, obj
            else:
                bad.append(f"{path}:{n}: not a JSON object")


TOKEN_LIMIT = 1 << 31  # tokens one request schedules in one step; a model's context is ~1e6


def _shown(value: object) -> str:
    """A value as the log's JSON writes it (Infinity, NaN), cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        if value.bit_length() > 13_000:
            return "a number of thousands of digits"  # str() refuses 4300+ digits
        text = str(value)
        return f"{text[:40]}... ({len(text)} digits)"
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _tokens(request: JsonObject, where: Callable[[], str], k: int) -> int:
    """A request's `tokens`: a whole number in 0..TOKEN_LIMIT (0 where absent), else bad input."""
    value = request.get("tokens", 0)
    if type(value) is int and 0 <= value <= TOKEN_LIMIT:
        return value
    raise UserError(
        f"{where()}: `requests[{k}].tokens` is {_shown(value)}; rl-msprobe's helpers write the number of "
        f"tokens the step scheduled for the request there, a whole number in 0..{TOKEN_LIMIT:,}. "
        "The log was edited or is not one of theirs: fix or remove that line."
    )


class Request(msgspec.Struct, gc=False):
    """One request of a step as the dispatch log holds it: the id as text, the type where it is
    text (only "new" and "cached" mean anything), the validated token count. msgspec decodes a
    batch of them straight from the log's text (DECODE_REQUESTS), validating in C; whatever it
    refuses is read by json and validated in Python (`_request`), with the same outcome."""

    request_id: str
    type: str | None = None
    tokens: Annotated[int, msgspec.Meta(ge=0, le=TOKEN_LIMIT)] = 0


DECODE_REQUESTS = msgspec.json.Decoder(list[Request])


def _request(r: object, where: Callable[[], str], k: int) -> Request:
    """Request k of a line as json parsed it (a line that fits in one read, or a batch msgspec
    refused); UserError for what is not a {request_id, type, tokens} object."""
    if type(r) is not dict:
        raise UserError(
            f"{where()}: `requests` is a list holding {type(r).__name__} {str(r)[:60]!r} at [{k}]; the "
            "dispatch log holds {request_id, type, tokens} objects there. Fix or remove that line."
        )
    kind = r.get("type")
    return Request(str(r.get("request_id")), kind if type(kind) is str else None, _tokens(r, where, k))


def _continues_prefill(request: Request) -> bool:
    """A `cached` entry scheduling more than one token: the rest of a chunked prompt (or speculative
    tokens). One token is a plain decode riding along in a mixed step."""
    return request.type == "cached" and request.tokens > 1


_ID_LIMIT = 10**18  # pids, steps and ranks become folder names; past this they are not a run's


@overload
def _id(value: object, where: str, key: str, required: Literal[True] = True) -> int: ...
@overload
def _id(value: object, where: str, key: str, required: bool) -> int | None: ...
def _id(value: object, where: str, key: str, required: bool = True) -> int | None:
    """A pid / step / rank from a log: digits only (they become folder names), else bad input."""
    if type(value) is int and 0 <= value < _ID_LIMIT:
        return value
    if value is None and not required:
        return None
    if isinstance(value, bool) or not (
        (isinstance(value, int) and 0 <= value < _ID_LIMIT)
        or (isinstance(value, str) and _DIGITS.match(value) and len(value) < 19)
    ):
        huge = isinstance(value, int) and value.bit_length() > 64  # repr() refuses 4300+ digits
        shown = "a number of more than 19 digits" if huge else repr(value)[:60]
        raise UserError(
            f"{where}: `{key}` is {shown}; rl-msprobe's helpers write a non-negative integer below "
            f"{_ID_LIMIT:,} there. "
            "The log was edited or is not one of theirs: fix or remove that line."
        )
    return int(value)


def _pid(line: JsonObject, log: Path, where: str) -> int | None:
    """The line's pid, else its {pid} folder's name, else None (a log straight in the root)."""
    if "pid" in line:
        return _id(line["pid"], where, "pid")
    return int(log.parent.name) if _DIGITS.match(log.parent.name) else None


def _requests(line: JsonObject, where: Callable[[], str]) -> Iterator[list[Request]]:
    """A line's requests, validated, a batch at a time (a `jsonl.Streamed` list is read as it goes;
    ValueError where its line turns out not to be JSON)."""
    requests = line.get("requests")
    if requests is None:
        return
    if isinstance(requests, jsonl.Streamed):
        batches: Iterator[list[Any]] = requests.batches(DECODE_REQUESTS)
    elif isinstance(requests, list):
        batches = iter((requests,))
    else:
        raise UserError(
            f"{where()}: `requests` is {type(requests).__name__} {str(requests)[:60]!r}; the dispatch log "
            "holds a list of {request_id, type, tokens} objects there. Fix or remove that line."
        )
    k = 0
    for batch in batches:
        if batch and type(batch[0]) is not Request:  # msgspec's batches are all Requests, json's none
            batch = [_request(r, where, k + n) for n, r in enumerate(batch)]
        k += len(batch)
        yield batch


def _stage(batch: list[Request], fresh: list[str], going_on: list[str]) -> None:
    """The requests of a prefill step: the ids of the new ones, and of those continuing a prompt
    (`_continues_prefill`). A step may hold a million: one comprehension each, and the ids are
    stripped one by one only where one of the batch's ends as a suffix would."""
    strip = strip_request_id
    ids = [r.request_id for r in batch if r.type == "new"]
    fresh += [strip(rid) for rid in ids] if _SUFFIXED.search("\n".join(ids) + "\n") else ids
    going_on += [strip(r.request_id) for r in batch if r.type == "cached" and r.tokens > 1]


# (pid, rank, step, where) of one rank's one-request prefill
_Prefill = tuple[int | None, int | None, int, str]


# A rollout candidate: (pid, rank, step, where) of the one-request prefill; `chunked` once a
# later prefill of the same id shows the prompt was split over several steps.
@dataclass(slots=True)
class _Candidate:
    pid: int | None
    rank: int | None
    step: int
    where: str
    matched: bool = False
    chunked: bool = False
    tp_size: int | None = None
    peers: list[_Prefill] = field(default_factory=list)  # of the other TP ranks

    def ranks(self) -> list[_Prefill]:
        if not self.peers:  # TP 1: no sort (asked several times per pair)
            return [(self.pid, self.rank, self.step, self.where)]
        return sorted([(self.pid, self.rank, self.step, self.where), *self.peers], key=lambda p: p[1] or 0)

    def peer_of(self, pid: object, rank: object) -> bool:
        """Another TP worker (its own pid and rank) of the same engine step, not a second prefill."""
        seen = self.ranks()
        return pid not in {p[0] for p in seen} and rank is not None and rank not in {p[1] for p in seen}


BATCHED_LISTED = 20  # requests of one batched step named one by one; the rest are counted in one entry


def _batched_only(batched: dict[str, str], candidates: dict[str, _Candidate]) -> Iterator[Unmatched]:
    """The rollout's requests only ever prefilled together with others, per step: the first
    BATCHED_LISTED by id, then one entry counting the rest (a step of a million requests would
    otherwise be a million identical lines)."""
    counts = Counter(
        batched.values() if not candidates else (w for r, w in batched.items() if r not in candidates)
    )
    left = sum(min(BATCHED_LISTED, n) for n in counts.values())  # entries by id still to list
    listed: Counter[str] = Counter()
    for rid, where in batched.items():
        if left == 0:
            break
        if rid in candidates or listed[where] >= BATCHED_LISTED:
            continue
        listed[where] += 1
        left -= 1
        yield Unmatched(
            rid, "rollout", f"prefilled together with other requests ({where}); not comparable alone"
        )
    for where, count in counts.items():
        if count > BATCHED_LISTED:
            yield Unmatched(
                None,
                "rollout",
                f"{count - BATCHED_LISTED:,} more requests prefilled together with other requests ({where}); "
                "not comparable alone",
            )


def correlate(rollout_root: Path, train_root: Path) -> Correlation:
    """Join the two sides' logs across every pid and rank (see the module doc)."""
    rollout_logs, train_logs = find_logs(rollout_root, DISPATCH_LOG), find_logs(train_root, TRAIN_LOG)
    result = Correlation(
        logs={"rollout": [str(p) for p in rollout_logs], "train": [str(p) for p in train_logs]}
    )
    skipped = result.skipped
    bad: list[str] = []
    candidates: dict[str, _Candidate] = {}
    batched: dict[str, str] = {}  # id -> where it was prefilled together with others
    cache_hits: dict[str, str] = {}  # id -> where its only prefill started from cached tokens
    strip = strip_request_id

    for log in rollout_logs:
        folder = log.parent.name
        for n, line in read_jsonl(log, bad, "requests"):

            def at(n: int = n, log: Path = log) -> str:
                return f"{log}:{n}"

            phase = line.get("phase")
            first: Request | None = None
            fresh: list[str] = []  # the ids of type new, and of prefills continuing
            going_on: list[str] = []
            count = 0
            try:
                for batch in _requests(line, at):  # a decode step's are checked, nothing is kept
                    if phase != "prefill" or not batch:
                        continue
                    first = batch[0] if first is None else first
                    count += len(batch)
                    if count > 1:  # one request alone is not staged: it is `first`
                        if count - len(batch) == 1:
                            _stage([first], fresh, going_on)
                        _stage(batch, fresh, going_on)
            except ValueError:  # a long line cut short: nothing learnt from it is kept
                bad.append(f"{at()}: not a JSON line (cut short by a killed process?)")
                continue
            if phase != "prefill":
                skipped["rollout: decode step" if phase == "decode" else f"rollout: phase {phase!r}"] += 1
                continue
            where = at()
            if count != 1 or first is None:
                skipped["rollout: prefill with several requests" if count else "rollout: no requests"] += 1
                if count:
                    step_at = f"{folder}/step{line.get('step')}"
                    if candidates:
                        fresh = [rid for rid in fresh if rid not in candidates]
                    new = dict.fromkeys(fresh, step_at)  # an id keeps the step it was first seen in
                    if batched:
                        for rid in new.keys() & batched.keys():
                            del new[rid]
                        batched.update(new)
                    else:
                        batched = new
                    for rid in going_on:
                        if rid in candidates:
                            candidates[rid].chunked = True
                continue
            req = first
            rid = strip(req.request_id)
            if req.type != "new":
                skipped["rollout: prefill continuing a request (type cached)"] += 1
                if rid in candidates and _continues_prefill(req):
                    candidates[rid].chunked = True
                elif rid not in candidates:  # no prefill from token 0: a prefix / radix cache hit
                    cache_hits.setdefault(rid, f"{folder}/step{line.get('step')}, {req.tokens} token(s)")
                continue
            pid = _pid(line, log, where)
            rank = _id(line.get("rank"), where, "rank", required=False)
            step = _id(line.get("step"), where, "step")
            if rid in candidates:
                first_seen = candidates[rid]
                if first_seen.peer_of(pid, rank):
                    skipped["rollout: one-request prefill (TP peer rank)"] += 1
                    first_seen.peers.append((pid, rank, step, where))
                else:
                    skipped["rollout: repeated prefill of a request"] += 1
                continue
            skipped["rollout: one-request prefill"] += 1
            tp_size = _id(line.get("tp_size"), where, "tp_size", required=False)
            candidates[rid] = _Candidate(pid, rank, step, where, tp_size=tp_size)

    # without `tp_size` in the log (older helpers): the widest TP group seen is the expected one
    tp_width = max((len(c.ranks()) for c in candidates.values()), default=1)
    rollout_index, train_index = DumpIndex(rollout_root), DumpIndex(train_root)
    for log in train_logs:
        for n, line in read_jsonl(log, bad):
            ids = line.get("request_ids")
            if not isinstance(ids, list) or not ids:
                skipped["train: no request_ids"] += 1
                result.unmatched.append(
                    Unmatched(
                        None, "train", f"{log}:{n}: micro-batch without request ids (verl-request-id patch?)"
                    )
                )
                continue
            if len(ids) != 1:
                skipped["train: micro-batch with several requests"] += 1
                for rid in ids:
                    result.unmatched.append(
                        Unmatched(
                            strip(str(rid)),
                            "train",
                            f"micro-batch {log.parent.name}/step{line.get('step')} held {len(ids)} requests "
                            "(set micro batch sizes to 1)",
                        )
                    )
                continue
            rid = strip(str(ids[0]))
            cand = candidates.get(rid)
            if cand is None:
                skipped["train: no rollout match"] += 1
                batched_at = batched.pop(rid, None)
                hit = cache_hits.get(rid)
                why = (
                    f"the rollout prefilled it together with other requests ({batched_at})"
                    if batched_at
                    else f"its rollout prefill ({hit}) started from cached tokens (a prefix / radix cache hit): "
                    "the dump covers only the rest of the prompt; turn the cache off (vLLM "
                    "enable_prefix_caching=False, SGLang engine_kwargs.sglang.disable_radix_cache=True)"
                    if hit
                    else "no rollout prefill step with this id"
                )
                result.unmatched.append(Unmatched(rid, "train", why))
                continue
            skipped["train: matched"] += 1
            cand.matched = True
            if cand.chunked:
                result.unmatched.append(
                    Unmatched(
                        rid,
                        "rollout",
                        "prefill continued in a later step (chunked prefill, or re-prefilled after preemption): its first dump covers part of the prompt",
                    )
                )
                continue
            where = f"{log}:{n}"
            pid = _pid(line, log, where)
            rank = _id(line.get("rank"), where, "rank", required=False)
            step = _id(line.get("step"), where, "step")
            expected = cand.tp_size or tp_width
            ranks = cand.ranks()
            if expected and len(ranks) < expected:
                have = ", ".join(f"pid {p[0]} rank {p[1]}" for p in ranks)
                result.unmatched.append(
                    Unmatched(
                        rid,
                        "rollout",
                        f"missing TP rank: its prefill was logged by {len(ranks)} of {expected} "
                        f"tensor-parallel ranks ({have}); a TP rank's dispatch log or dumps are missing",
                    )
                )
                continue
            sides = []
            for r_pid, r_rank, r_step, _ in ranks:
                r_dump = rollout_index.find(r_pid, r_step, r_rank)
                if r_dump is None:
                    break
                sides.append(Side(r_pid, r_rank, r_step, r_dump))
            t_dump = train_index.find(pid, step, rank)
            if len(sides) < len(ranks) or t_dump is None:
                if len(sides) < len(ranks):
                    r_pid, r_rank, r_step, _ = ranks[len(sides)]
                    side, missing = "rollout", rollout_index.expected(r_pid, r_step, r_rank)
                else:
                    side, missing = "train", train_index.expected(pid, step, rank)
                result.unmatched.append(
                    Unmatched(rid, side, f"missing dump: {missing}", Unpaired.MISSING_DUMP)
                )
                continue
            result.pairs.append(Pair(rid, sides[0], Side(pid, rank, step, t_dump), tuple(sides[1:])))

    for rid, cand in candidates.items():
        if not cand.matched:
            result.unmatched.append(Unmatched(rid, "rollout", "no training micro-batch with this id"))
    result.unmatched.extend(_batched_only(batched, candidates))
    for b in bad:
        result.unmatched.append(
            Unmatched(None, "rollout" if DISPATCH_LOG in b else "train", b, Unpaired.BAD_LINE)
        )
    return result

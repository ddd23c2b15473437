"""One document per run: per sync, per tensor, sent vs received and received vs resident.

- `received` (a transfer finding): what a TP rank got, against what the actor sent, same layout:
  the statistics in float64 plus the bit-exact hash where both sides have one.
- `resident` (a loader finding): what the ranks hold (or their loader wrote), each HF tensor
  combined over the ranks (shards add; elements on r ranks are divided out), against what they
  received (what was sent where no rank fingerprinted its input), with the tolerance of a dtype
  conversion when the engine holds another dtype.
A tensor the engine holds under two names (tied embeddings) is `tied`: accounted for by the name
it is loaded under. An engine tensor the sync never wrote on a rank is `not-synced` (NOT SYNCED,
by name, shape and rank): the rank holds it but received nothing under its name in this sync
(while it received other tensors), or, in reset mode, it still holds the pattern. The model's tensors are the engine's (resident) ones plus its tied names: a
sync whose sent tensors are not exactly those is never EQUAL.
Where one side holds only its checksum (lazy statistics, `"fp": null`), the k64 checksums of the
same dtype and shape decide (`_by_checksum`); where there are none to decide by, the tensor is
NOT COMPARED, never EQUAL.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import cast

from rl_msprobe.weights.document import (
    FindingDoc,
    FirstDifference,
    NotSynced,
    SyncSummary,
    TensorRow,
    WeightsDoc,
    Where,
)
from rl_msprobe.weights.experts import expert_of
from rl_msprobe.weights.fingerprint import Delta, combine_ranks, compare, unit_roundoff
from rl_msprobe.weights.records import Entry, Run

EQUAL, DIFFERENT, NOT_COMPARED = "EQUAL", "DIFFERENT", "NOT COMPARED"
STATUSES = ("equal", "differs", "missing", "not-compared", "tied", "not-synced")


@dataclass
class Finding:
    status: str
    ranks: list[int]
    delta: Delta | None = None
    why: str = ""
    faulty_ranks: list[int] | None = None  # resident: the ranks whose own part differs, where that is known

    def to_dict(self) -> FindingDoc:
        doc: FindingDoc = {"status": self.status}
        if self.ranks:
            doc["ranks"] = self.ranks
        if self.faulty_ranks:
            doc["faulty_ranks"] = self.faulty_ranks
        if self.delta is not None:
            doc = {**doc, **self.delta.to_dict()}
        if self.why:
            doc["why"] = self.why
        return doc


BLIND = (
    "one side holds only its checksum (lazy statistics) and the other no checksum of the same dtype "
    "and shape; rerun with RL_MSPROBE_WEIGHTS_STATS=all (or the same RL_MSPROBE_WEIGHTS_HASH everywhere)"
)


def _by_checksum(ref: Entry, got: Entry) -> Delta | None:
    """Where one side's statistics were not taken: equal k64 checksums of the same dtype and shape
    are the same bytes; unequal ones other bytes (how they differ is unknown: no statistics). None
    where the checksums cannot decide."""
    if not (ref.hash and got.hash and ref.dtype == got.dtype and ref.shape == got.shape):
        return None
    if ref.hash == got.hash:
        return Delta(True, 0.0, 0.0, "none")
    known = "" if ref.fp is None and got.fp is None else " on one side"
    return Delta(False, 1.0, math.inf, f"bits (hash differs; statistics not taken{known}: lazy)")


def _same(ref: Entry, got: Entry) -> Delta | None:
    """Sent vs received: the same layout, so the same dtype is bit-for-bit when the hashes say so.
    None: the checksums cannot decide where a side has no statistics (`_by_checksum`)."""
    if ref.fp is None or got.fp is None:
        return _by_checksum(ref, got)
    roundoff = 0.0 if ref.dtype == got.dtype else max(unit_roundoff(ref.dtype), unit_roundoff(got.dtype))
    delta = compare(ref.fp, got.fp, roundoff)
    if delta.equal and ref.hash and got.hash and ref.hash != got.hash and ref.dtype == got.dtype:
        return Delta(False, 1.0, delta.norm_rel, "bits (hash differs, statistics equal in float64)")
    return delta


def replicas_by_rank(processes: dict[str, dict[str, Entry]]) -> list[dict[int, dict[str, Entry]]]:
    """Engine processes grouped into replicas: the i-th process of each TP rank forms replica i."""
    ranks: dict[int, list[str]] = defaultdict(list)
    for process, entries in sorted(processes.items()):
        rank = next(iter(entries.values())).rank if entries else 0
        ranks[rank].append(process)
    count = max((len(v) for v in ranks.values()), default=0)
    return [{r: processes[ps[i]] for r, ps in ranks.items() if i < len(ps)} for i in range(count)]


def _received(sent: Entry | None, received: dict[int, dict[str, Entry]], name: str) -> Finding:
    if not received:
        return Finding("not-compared", [], why="no rank fingerprinted what it received")
    got = {r: e[name] for r, e in received.items() if name in e}
    if sent is None:
        return Finding("missing", sorted(got), why="received but not sent" if got else "held, never sent")
    missing = sorted(set(received) - set(got))
    if missing:
        return Finding("missing", missing, why="sent but not received by these ranks")
    deltas = {r: _same(sent, e) for r, e in sorted(got.items())}
    return _finding(deltas, bad_ranks=None)


def _finding(deltas: dict[int, Delta | None], bad_ranks: list[int] | None) -> Finding:
    """Differs where a rank's delta says so (its ranks, or BAD_RANKS' ranks with those as the faulty
    ones), else NOT COMPARED where one cannot tell (`_by_checksum`), else equal."""
    bad = [r for r, d in deltas.items() if d is not None and not d.equal]
    if bad:
        first = deltas[bad[0]]
        if bad_ranks is None:
            return Finding("differs", bad, first)
        return Finding("differs", bad_ranks, first, faulty_ranks=bad)
    blind = [r for r, d in deltas.items() if d is None]
    if blind:
        return Finding("not-compared", blind, why=BLIND)
    return Finding("equal", [], max((d for d in deltas.values() if d), key=lambda d: d.ratio))


def _shard_dim(held: tuple[int, ...] | None, whole: tuple[int, ...] | None, tp: int) -> int | None:
    """The dim along which a rank's HELD part is its 1/TP of the WHOLE tensor (others equal), else None."""
    if held is None or whole is None or len(held) != len(whole):
        return None
    dims = [d for d, (h, w) in enumerate(zip(held, whole)) if h != w]
    return dims[0] if len(dims) == 1 and held[dims[0]] * tp == whole[dims[0]] else None


def _faulty_ranks(
    reference: Entry, held: dict[int, Entry], received: dict[int, dict[str, Entry]], name: str, tp: int | None
) -> list[int] | None:
    """The ranks whose own part differs: a full copy against the reference, a TP shard against the
    same rank's chunk of what it received. None when some rank's part cannot be told apart."""
    faulty = []
    for rank, entry in sorted(held.items()):
        if entry.fp is None or reference.fp is None:
            return None
        expected = reference.fp if entry.fp.count == reference.fp.count else None
        got = received.get(rank, {}).get(name)
        if expected is None and got is not None and tp:
            dim = _shard_dim(entry.shape, got.shape, tp)
            expected = got.shards.get(dim) if dim is not None else None
        if expected is None:
            return None
        dtypes = {entry.dtype, reference.dtype}
        roundoff = 0.0 if len(dtypes) == 1 else max(map(unit_roundoff, dtypes))
        if not compare(expected, entry.fp, roundoff).equal:
            faulty.append(rank)
    return faulty or None


def _other_bits(reference: Entry, held: dict[int, Entry]) -> list[int]:
    """The ranks whose part has the reference's dtype and shape but another checksum: other bytes,
    even where the statistics agree (a permutation). Resident parts carry one where the helper
    checked them against what was received (same dtype and shape)."""
    return [
        rank
        for rank, e in sorted(held.items())
        if e.hash
        and reference.hash
        and (e.dtype, e.shape) == (reference.dtype, reference.shape)
        and e.hash != reference.hash
    ]


def resident_finding(
    reference: Entry | None,
    resident: dict[int, dict[str, Entry]],
    name: str,
    aliases: dict[str, str],
    received: dict[int, dict[str, Entry]] | None = None,
    tp: int | None = None,
) -> tuple[Finding, int | None, str | None]:
    """Received vs resident for NAME (the module doc's loader finding): the finding, the replicas its
    ranks' shards combine to and how the engine fingerprinted it. Shared with the checkpoint compare."""
    if name in aliases:
        return Finding("tied", [], why=f"held as {aliases[name]}"), None, None
    if not resident:
        return Finding("not-compared", [], why="no rank fingerprinted what it holds"), None, None
    held = {r: e[name] for r, e in resident.items() if name in e}
    if not held:
        why = "not held by the engine" if reference is not None else "held but not sent"
        return Finding("missing", [], why=why), None, None
    how = next(iter(held.values())).how
    if reference is None:
        return Finding("missing", sorted(held), why="held but not sent"), None, how
    unreadable = sorted(r for r, e in held.items() if e.unreadable)
    if unreadable:
        why = "the engine repacked it before it could be fingerprinted"
        return Finding("not-compared", unreadable, why=why), None, how
    fps = [e.fp for e in held.values() if e.fp is not None]
    if reference.fp is None or len(fps) < len(held):  # lazy statistics
        deltas = {r: _by_checksum(reference, e) for r, e in sorted(held.items())}
        return _finding(deltas, bad_ranks=sorted(held)), None, how
    try:
        whole, replicas = combine_ranks(fps, reference.fp.count)
    except ValueError as exc:
        return Finding("differs", sorted(held), Delta(False, float("inf"), float("inf"), str(exc))), None, how
    dtypes = {e.dtype for e in held.values()}
    roundoff = 0.0 if dtypes == {reference.dtype} else max(map(unit_roundoff, dtypes | {reference.dtype}))
    delta = compare(reference.fp, whole, roundoff)
    bits = _other_bits(reference, held) if delta.equal else []
    if bits:
        delta = Delta(False, 1.0, delta.norm_rel, "bits (hash differs, statistics equal in float64)")
        return Finding("differs", sorted(held), delta, faulty_ranks=bits), replicas, how
    if delta.equal:
        return Finding("equal", [], delta), replicas, how
    faulty = _faulty_ranks(reference, held, received or {}, name, tp)
    return Finding("differs", sorted(held), delta, faulty_ranks=faulty), replicas, how


def _not_synced(
    resident: dict[int, dict[str, Entry]],
    received: dict[int, dict[str, Entry]],
    name: str,
    told: dict[str, dict[int, set[str]]],
) -> Finding | None:
    """NOT SYNCED (module doc): the ranks holding NAME that this sync never wrote it on. TOLD: the
    helper's meta lines, rank -> names: `unwritten` (still unloaded when the sync returned: no
    resident record), `reset_kept` (holding reset mode's pattern when the next sync began)."""
    unloaded = sorted(
        r for r, names in told["unwritten"].items() if name in names and name not in resident.get(r, {})
    )
    kept = sorted(
        {r for r, e in resident.items() if name in e and e[name].reset_kept}
        | {r for r, names in told["reset_kept"].items() if name in names}
    )
    unsent = sorted(
        r
        for r in set(resident) | set(unloaded)
        if received.get(r) and name not in received[r] and (name in resident.get(r, {}) or r in unloaded)
    )
    ranks = sorted(set(kept) | set(unsent) | set(unloaded))
    if not ranks:
        return None
    why = "; ".join(
        text
        for text, where in (
            (f"rank(s) {unloaded} had not loaded it when the sync returned", unloaded),
            (f"still holds the reset pattern after the sync on rank(s) {kept}", kept),
            (f"rank(s) {unsent} received other tensors in this sync but not this one", unsent),
        )
        if where
    )
    return Finding("not-synced", ranks, why=why)


def _told(run: Run, sync: int) -> dict[str, dict[int, set[str]]]:
    """The meta lines' `unwritten` / `reset_kept` names of SYNC, by rank (see `_not_synced`)."""
    out: dict[str, dict[int, set[str]]] = {"unwritten": defaultdict(set), "reset_kept": defaultdict(set)}
    for doc in run.meta.get(sync, {}).values():
        rank = doc.get("rank")
        for key, by_rank in out.items():
            names = doc.get(key)
            if isinstance(rank, int) and isinstance(names, list):
                by_rank[rank].update(str(n) for n in names)
    return out


def _reference(
    sent: Entry | None, received: dict[int, dict[str, Entry]], name: str
) -> tuple[Entry | None, str]:
    """What the resident side must match: what the ranks received when they agree, else nothing."""
    got = [e[name] for _, e in sorted(received.items()) if name in e]
    if not got:
        return sent, ""
    first = got[0]
    deltas = [_same(first, e) for e in got[1:]]
    if all(d is not None and d.equal for d in deltas):
        return first, ""
    if all(d is None or d.equal for d in deltas):
        return None, f"whether the ranks received the same tensor is unknown: {BLIND}"
    return None, "the ranks received different tensors"


def sync_meta(run: Run, sync: int) -> tuple[dict[str, str], int | None, list[str]]:
    """(tied aliases, TP size, every name the engine says it holds: SGLang's helper lists them)."""
    aliases: dict[str, str] = {}
    tp = None
    holds: dict[str, None] = {}
    for doc in run.meta.get(sync, {}).values():
        aliases.update(doc.get("aliases") or {})
        tp = doc.get("tp_size", tp)
        holds.update(dict.fromkeys(str(n) for n in doc.get("holds") or ()))
    return aliases, tp, list(holds)


def compare_sync(run: Run, sync: int) -> tuple[SyncSummary, list[TensorRow]]:
    sent_procs = run.entries["sent"].get(sync, {})
    sent_proc = (
        min(sent_procs, key=lambda p: (next(iter(sent_procs[p].values())).rank, p)) if sent_procs else None
    )
    sent = sent_procs.get(sent_proc, {}) if sent_proc else {}
    replicas_received = replicas_by_rank(run.entries["received"].get(sync, {})) or [{}]
    replicas_resident = replicas_by_rank(run.entries["resident"].get(sync, {})) or [{}]
    aliases, tp, holds = sync_meta(run, sync)
    step = next((e.step for e in sent.values() if e.step is not None), None)
    rows: list[TensorRow] = []
    not_synced: list[NotSynced] = []
    told = _told(run, sync)
    for replica in range(max(len(replicas_received), len(replicas_resident))):
        received = replicas_received[replica] if replica < len(replicas_received) else {}
        resident = replicas_resident[replica] if replica < len(replicas_resident) else {}
        names = dict.fromkeys(sorted(sent, key=lambda n: sent[n].index))
        for entries in (*received.values(), *resident.values()):
            names.update(dict.fromkeys(entries))
        names.update(dict.fromkeys(a for a in aliases if a in sent))
        names.update(dict.fromkeys(n for n in holds if n not in aliases))
        for order, name in enumerate(names):
            entry = sent.get(name)
            rec = _received(entry, received, name)
            reference, why = _reference(entry, received, name)
            if why and entry is not None:
                res, replicas, how = Finding("not-compared", [], why=why), None, None
            else:
                res, replicas, how = resident_finding(reference, resident, name, aliases, received, tp)
            unwritten = _not_synced(resident, received, name, told) if res.status != "tied" else None
            if unwritten is not None:
                res = unwritten
                shape = next(
                    (e[name].shape for e in (*resident.values(), *received.values()) if name in e), None
                )
                not_synced.append(
                    {
                        "sync": sync,
                        "name": name,
                        "shape": list(shape) if shape else None,
                        "ranks": unwritten.ranks,
                        "why": unwritten.why,
                    }  # fmt: skip
                )
            row: TensorRow = {
                "sync": sync,
                "step": step,
                "index": entry.index if entry else None,
                "order": order,
                "name": name,
                "received": rec.to_dict(),
                "resident": res.to_dict(),
            }
            if replica:
                row["replica"] = replica
            if replicas is not None:
                row["replicas"] = replicas
            if how:
                row["how"] = how
            expert = expert_of(name)
            if expert is not None:
                row["expert"] = expert
            rows.append(row)
    counts = {s: 0 for s in STATUSES}
    for row in rows:
        for stage in ("received", "resident"):
            counts[row[stage]["status"]] += 1
    model = {
        n
        for row in rows
        for n in [row["name"]]
        if row["resident"]["status"] in ("equal", "differs", "tied", "not-synced")
    }
    hows: dict[str, int] = defaultdict(int)  # resident fingerprints by where they come from
    reused = sum(
        e.same_as == "received" for p in run.entries["resident"].get(sync, {}).values() for e in p.values()
    )
    received_reused = sum(
        e.same_as == "sent" for p in run.entries["received"].get(sync, {}).values() for e in p.values()
    )
    received_implied = sum(
        e.implied_by == "resident" for p in run.entries["received"].get(sync, {}).values() for e in p.values()
    )
    for row in rows:
        if row.get("how"):
            hows[row["how"]] += 1
    if not sent or not any(replicas_resident):
        verdict = NOT_COMPARED
    elif counts["differs"] or counts["not-synced"]:
        verdict = DIFFERENT
    elif counts["missing"] or counts["not-compared"] or len(sent) != len(model):
        verdict = NOT_COMPARED
    else:
        verdict = EQUAL
    summary: SyncSummary = {
        "sync": sync,
        "step": step,
        "verdict": verdict,
        "sent_tensors": len(sent),
        "model_tensors": len(model),
        "tp_size": tp,
        "replicas": max(len(replicas_received), len(replicas_resident)),
        "counts": counts,
        "resident_how": dict(hows),
        "resident_reused": reused,
        "received_reused": received_reused,
        "received_implied": received_implied,
        "not_synced": not_synced,
    }
    return summary, rows


def _first_difference(rows: list[TensorRow]) -> FirstDifference | None:
    for row in sorted(rows, key=lambda r: (r["sync"], r["order"], r.get("replica", 0))):
        for stage in ("received", "resident"):
            finding = row[stage]
            if finding["status"] == "differs":
                where: Where = {
                    "step": row["step"],
                    "sync": row["sync"],
                    "name": row["name"],
                    "stage": stage,
                    "index": row["index"],
                }
                first = cast(FirstDifference, {**where, **finding})
                del first["status"]  # `differs`: said by being the first difference
                if "expert" in row:  # which layer, expert and projection (a per-expert MoE tensor)
                    first["expert"] = row["expert"]
                return first
    return None


def compare_run(run: Run) -> WeightsDoc:
    """The whole comparison document (what `weights compare --json` prints)."""
    steps: list[SyncSummary] = []
    rows: list[TensorRow] = []
    for sync in run.syncs():
        summary, sync_rows = compare_sync(run, sync)
        steps.append(summary)
        rows.extend(sync_rows)
    verdicts = [s["verdict"] for s in steps]
    if DIFFERENT in verdicts:
        verdict = DIFFERENT
    elif not verdicts or NOT_COMPARED in verdicts:
        verdict = NOT_COMPARED
    else:
        verdict = EQUAL
    return {
        "verdict": verdict,
        "folder": str(run.folder),
        "steps": steps,
        "tensors": rows,
        "first_difference": _first_difference(rows),
        "not_synced": [x for s in steps for x in s["not_synced"]],
    }

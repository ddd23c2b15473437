"""Weight-parity fingerprints at every weight sync. Added to this tree by rl-msprobe (patch set
verl-weights in a verl tree, sglang-weights in an SGLang tree: the same file).

The sync code calls these functions from a few marked lines (`# rl-msprobe:...`); run
`rl-msprobe patch revert <that set> --tree <this tree>` to remove them and this file.

Environment (read at every call, so Ray workers and the vLLM worker see what their runtime env gives):
  RL_MSPROBE_WEIGHTS_DIR=DIR  enable; unset or empty: every function returns at once and torch
                              and numpy are never imported here
  RL_MSPROBE_WEIGHTS_HASH=0   skip the bit-exact checksum ("k64:...", see `_Keyed`) of sent and
                              received tensors (the statistics are then taken at every stage;
                              without checksums no statistics are reused or left out)
  RL_MSPROBE_WEIGHTS_STATS=all the sender takes the statistics too. By default (`lazy`) it takes
                              only the checksum (`"fp": null`): the statistics are taken at the
                              first later stage whose checksum cannot stand for them (a received
                              tensor that differs from the sent one, or whose resident part has
                              another layout, dtype or TP shard; a resident part that differs
                              from what arrived; every resident part of a process's first sync,
                              what `weights compare --checkpoint` reads), so a sync whose bytes
                              arrive and load unchanged costs two checksums and no statistics
  RL_MSPROBE_WEIGHTS_RESET=N  reset mode, for a debugging run: at the start of sync N (1: the first;
                              "N,M": several) every floating engine parameter is filled with
                              `PATTERN` (and the parameters a layer-by-layer reload keeps aside
                              while the layer is on meta); each resident record of that sync says
                              whether its part still holds it (`"reset_kept"`), and so does a meta
                              line written at the model's first forward after the sync (or the
                              next sync's start): what the sync never wrote. The engine then
                              serves those parameters as the pattern, so never in a run whose
                              results matter.

Three stages, one JSON line per tensor in `DIR/{stage}-{host}-{pid}.jsonl`:
  sent      every (HF name, tensor) the actor's engine hands to the sync (`sent`, wrapping the
            generator of `get_per_tensor_param()` lazily: a tensor is fingerprinted as it is
            consumed), per actor rank; with lazy statistics (the default) only its checksum;
  received  every tensor the rollout worker gets, before its loader fuses or shards it
            (`received`, first line of the vLLM worker extension's `_update_weights`;
            `call_received` in SGLang's `update_weights_from_tensor`, once per bucket), per TP rank;
            with TP > 1 also this rank's 1/TP chunk along dims 0 and 1 (`shard_fp`), so that a
            loader fault in one rank's shard names that rank. Where the sender's {hash, fp} came
            in the bucket's metadata (`tag` / `arrived`, verl's BucketedWeightSender / Receiver),
            only the checksum is taken: equal, the sender's statistics are written
            (`"same_as": "sent"`), else they are measured (so they are where the sender took
            none, lazy statistics: every TP > 1 rank's shards need the whole). On TP 1, where the receiver says it
            calls `settled()` after each bucket's load (`arrived(..., settles=True)`), even that
            checksum waits (`_deferred`): a resident part of the same name, dtype and shape
            checked while the bucket is loaded, its k64 equal to the sender's, holds the sent
            bytes, so the received ones were those too (`"same_as": "sent", "implied_by":
            "resident"`, one read of the tensor instead of two); any other resident checksum,
            or none by the end of the bucket (`settled`), and the received tensor is
            checksummed (and measured on a mismatch, or always where the sender took no
            statistics) as above, so that a transfer fault is
            still named at stage received and a loader fault at stage resident;
  resident  what the engine holds after the load, per TP rank, split back into HF names
            (fused q|k|v and gate|up by the layer's `output_partition_sizes` and the model's
            `packed_modules_mapping`; stacked MoE experts, w13 / w2, per expert and projection,
            `_expert_parts`; vocab padding rows dropped). Where the engine repacks a
            layer's weights after loading (vLLM CPU), the layer is fingerprinted just before its
            quant method's `process_weights_after_loading`, i.e. what the weight loader wrote
            (`"how": "loader-written"`); elsewhere the parameter as it stands after the sync
            (`"how": "parameter"`). SGLang: each tensor where the model holds it when the call
            that carried it returns (`engine_call`); the sync's meta line lists every name held.
            A part with the dtype and shape this process received under its name in this sync
            (TP 1, a replicated copy) gets its checksum first: equal to the received one, the
            received statistics are written (`"same_as": "received"`: the same bytes; none where
            none were taken), else its own are measured (`_resident_record`); with lazy
            statistics every part of a process's first sync is measured (`--checkpoint`).
A fingerprint is {count, sum, sumsq, min, max, nan, inf} in float64: additive over concatenation
and shards, invariant under permutation. Sync numbers count syncs per process (1, 2, ...).

This file depends on nothing but the standard library and (lazily, when enabled) torch and numpy; it never
imports rl-msprobe.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import sys

ENV = "RL_MSPROBE_WEIGHTS_DIR"
HASH_ENV = "RL_MSPROBE_WEIGHTS_HASH"
STATS_ENV = "RL_MSPROBE_WEIGHTS_STATS"
RESET_ENV = "RL_MSPROBE_WEIGHTS_RESET"
PATTERN = 0.0012345678  # reset mode's fill: no trained or initialised weight is this constant
FORMAT = 3  # 3: a record may hold only its checksum ("fp": null, lazy statistics); 2: k64 hashes; 1: CRC-32s

_counters = {"sent": 0, "engine": 0}
_warned: set[str] = set()


def enabled() -> bool:
    return bool(os.environ.get(ENV, "").strip())


def _hash_wanted() -> bool:
    return os.environ.get(HASH_ENV, "1").strip() != "0"


def _lazy() -> bool:
    """Statistics only where a checksum cannot stand for them (RL_MSPROBE_WEIGHTS_STATS, module doc)."""
    return _hash_wanted() and os.environ.get(STATS_ENV, "lazy").strip().lower() != "all"


@contextlib.contextmanager
def _never_breaks_the_sync(what: str):
    """A failure here costs fingerprints (the compare then reports them missing), never the sync."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - a debugging aid must not stop the job
        if what not in _warned:
            _warned.add(what)
            print(
                f"rl-msprobe weights: {what} failed ({type(exc).__name__}: {exc}); those fingerprints are "
                "missing, the weight sync goes on",
                file=sys.stderr,
            )


# ------------------------------------------------------------------------------ fingerprints


# Elements per block: a float32 block (1 MB) and its float64 scratch (2 MB) stay in cache while every
# reduction runs on them. Statistics of 379 MB fp32 on the 2-core dev machine: 64K 0.17 s, 256K 0.10 s,
# 1M 0.11 s, 4M 0.29 s (one whole-tensor pass per reduction, as before: 0.35 s; a memcpy: 0.31 s).
BLOCK = 1 << 18


def _pieces(tensor):
    """A CPU TENSOR's elements in row-major order in pieces of about BLOCK elements: 1-D views of
    its memory where it is contiguous; where not, groups of a few whole rows as strided views (numpy
    copies those into its float64 scratch far faster than torch's strided copy on a busy CPU)."""
    t = tensor.detach()
    if t.is_contiguous() or t.dim() < 2:
        yield from t.contiguous().reshape(-1).split(BLOCK)
        return
    yield from t.split(max(1, BLOCK // max(1, t[0].numel())))


def _raw(piece):
    """PIECE's bytes in row-major order, contiguous (a numpy copy where the piece is strided)."""
    import numpy as np
    import torch

    if piece.is_contiguous():
        return piece.reshape(-1).view(torch.uint8).numpy()
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[piece.element_size()]
    return np.ascontiguousarray(piece.view(same_size).numpy()).view(np.uint8)


def _blocks(tensor, raw: bool = True):
    """(values, raw) per piece of a CPU TENSOR: VALUES a numpy array numpy sums in float64 (the
    tensor's own memory for float16/32/64, a float32 copy otherwise: bfloat16, fp8), RAW its bytes
    (None unless RAW)."""
    import torch

    native = tensor.dtype in (torch.float16, torch.float32, torch.float64)
    for piece in _pieces(tensor):
        values = piece.numpy() if native else piece.to(torch.float32).numpy()
        yield values, (_raw(piece) if raw else None)


# The bit-exact checksum ("k64"): the tensor's bytes in row-major order, zero-padded to whole
# little-endian 64-bit words w_j, each folded (w ^ w >> 32: its high half reaches the low bits) and
# multiplied by an odd key that depends on its position j, summed modulo 2**64 and finished with
# the dtype and shape. A change within one word always changes the sum (fold and odd keys are
# bijections); changes in several words cancel only through a congruence of the keys, except the
# same bits flipped in both halves of two words (e.g. both float32 of two aligned pairs negated),
# which the statistics of the same line see. It guards transfers; it is no cryptographic hash. It runs
# inline on the block the statistics just read (no thread): 400 MB in ~0.05 s on the 2-core dev
# machine, where zlib's CRC-32 (FORMAT 1) took 0.10 s and the statistics take 0.09 s. Measured
# against it 2026-12-04 (load ~10, 508 MB): these four numpy passes per 1 MiB block 0.10 s (as fast
# as one numpy sum of the float32); np.dot for the multiply-and-sum 0.12 s (numpy's integer dot is
# a plain loop); torch int64 on one thread (its shift is arithmetic: one more pass, a mask) 0.13-0.15
# s against 0.08-0.09 s; sub-blocks sized for L2 (4K-64K words): no gain beyond the noise. Kept.
HASH_NAME = "k64"
WORDS = 1 << 17  # words per key block (1 MiB): word j is keyed KEYS[j % WORDS] * block key(j // WORDS)
_MASK = (1 << 64) - 1
_keys = []


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _word_keys():
    """WORDS odd 64-bit keys, the same in every process (splitmix64 of the position, in numpy)."""
    if not _keys or _keys[0].size != WORDS:
        import numpy as np

        _keys.clear()
        z = np.arange(1, WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        _keys.append((z ^ (z >> np.uint64(31))) | np.uint64(1))
    return _keys[0]


class _Keyed:
    """The k64 checksum of a byte stream fed in pieces of any length (`add`), by global position."""

    def __init__(self, header: str) -> None:
        self.header = header
        self.total = 0
        self.words = 0  # words summed so far
        self.carry = b""  # the bytes of an unfinished word
        self.scratch = None

    def add(self, raw) -> None:
        import numpy as np

        raw = raw.reshape(-1)  # contiguous bytes (`_raw`), 2-D for a group of rows
        if self.carry:
            need = 8 - len(self.carry)
            self.carry += raw[:need].tobytes()
            raw = raw[need:]
            if len(self.carry) < 8:
                return
            self._words(np.frombuffer(self.carry, dtype="<u8"))
            self.carry = b""
        whole = raw.size - raw.size % 8
        if whole:
            self._words(raw[:whole].view("<u8"))  # unaligned memory is fine (numpy loads it as fast)
        self.carry = raw[whole:].tobytes()

    def _words(self, words) -> None:
        import numpy as np

        keys = _word_keys()
        while words.size:
            at = self.words % WORDS
            part = words[: WORDS - at]
            if self.scratch is None or self.scratch.size < part.size:
                self.scratch = np.empty(max(part.size, min(WORDS, 1 << 12)), dtype=np.uint64)
            t = self.scratch[: part.size]
            np.right_shift(part, np.uint64(32), out=t)
            np.bitwise_xor(t, part, out=t)
            np.multiply(t, keys[at : at + part.size], out=t)  # modulo 2**64
            block_key = _mix(self.words // WORDS + (1 << 40)) | 1
            self.total = (self.total + block_key * int(np.add.reduce(t))) & _MASK
            self.words += part.size
            words = words[part.size :]

    def result(self) -> str:
        import numpy as np

        if self.carry:
            self._words(np.frombuffer(self.carry.ljust(8, b"\0"), dtype="<u8"))
            self.carry = b""
        return _finish(self.header, self.total)


def _finish(header: str, total: int) -> str:
    """The k64 string of a keyed word sum TOTAL and the tensor's HEADER (dtype and shape)."""
    import hashlib

    key = int.from_bytes(hashlib.blake2b(header.encode(), digest_size=8).digest(), "little")
    return f"{HASH_NAME}:{_mix((total + key) & _MASK):016x}"


DEVICE_BLOCKS = 64  # key blocks (1 MiB each) per step on a device: 64 MiB of int64 scratch


def _device_digest(tensor) -> str:
    """`digest` where the tensor lives (a GPU / NPU): the same k64 in int64 tensor arithmetic, whose
    two's-complement multiply and sum wrap modulo 2**64 as numpy's uint64 do (the fold's shift is
    arithmetic in int64, hence its mask); one int64 per 1 MiB key block crosses to the host, never
    the tensor. Runs on a CPU tensor too, where it must give `digest`'s value (the tests check it)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.storage_offset() % 8 or flat.numel() % 8:  # whole, aligned words: a padded copy
        padded = flat.new_zeros(flat.numel() + (-flat.numel()) % 8)
        padded[: flat.numel()] = flat
        flat = padded
    words = flat.view(torch.int64)
    keys = torch.from_numpy(_word_keys().view("<i8")).to(words.device)
    total, block = 0, 0
    for start in range(0, words.numel(), WORDS * DEVICE_BLOCKS):
        part = words[start : start + WORDS * DEVICE_BLOCKS]
        rows = -(-part.numel() // WORDS)
        if part.numel() != rows * WORDS:  # the last key block, zero-padded (a zero word adds nothing)
            part = torch.cat([part, part.new_zeros(rows * WORDS - part.numel())])
        part = part.view(rows, WORDS)
        folded = torch.bitwise_and(part >> 32, 0xFFFFFFFF).bitwise_xor_(part)
        sums = folded.mul_(keys).sum(dim=1).tolist()
        for s in sums:
            total = (total + (_mix(block + (1 << 40)) | 1) * (s & _MASK)) & _MASK
            block += 1
    return _finish(_header(tensor), total)


def _stats(blocks, keyed=None) -> tuple[float, float, float | None, float | None, int, int]:
    """One pass over BLOCKS ((values, raw) pairs): every reduction runs on a block while it is in
    cache, so memory is read once; the raw bytes go into KEYED (a `_Keyed` checksum) when given."""
    import numpy as np

    total = sumsq = 0.0
    low = high = None
    nan = inf = 0
    scratch = np.empty(0, dtype=np.float64)
    for a, raw in blocks:
        if keyed is not None:
            keyed.add(raw)
        if scratch.size < a.size:
            scratch = np.empty(max(a.size, BLOCK), dtype=np.float64)
        wide = scratch[: a.size]
        np.copyto(wide.reshape(a.shape), a)  # a strided piece is gathered here, in cache
        s = float(np.add.reduce(wide))
        q = float(np.add.reduce(np.multiply(wide, wide, out=wide)))
        if not (math.isfinite(s) and math.isfinite(q)):
            bad_nan, bad_inf = np.isnan(a), np.isinf(a)
            nan, inf = nan + int(bad_nan.sum()), inf + int(bad_inf.sum())
            a = a[~(bad_nan | bad_inf)]  # 1-D
            wide = a.astype(np.float64)
            s = float(np.add.reduce(wide))
            q = float(np.add.reduce(np.multiply(wide, wide, out=wide)))
        total, sumsq = total + s, sumsq + q
        if a.size:
            lo, hi = float(np.minimum.reduce(a, axis=None)), float(np.maximum.reduce(a, axis=None))
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
    return total, sumsq, low, high, nan, inf


CHUNK = 1 << 22  # elements per float64 block on a device


def _device_stats(tensor) -> tuple[float, float, float | None, float | None, int, int]:
    """The same statistics where the tensor lives (a GPU / NPU): float64 blocks of CHUNK elements
    on the device, so nothing but the six numbers crosses to the host."""
    import torch

    flat = tensor.detach().reshape(-1)
    total = sumsq = 0.0
    nan = inf = 0
    low = high = None
    for block in flat.split(CHUNK):
        block = block.to(torch.float64)
        finite = torch.isfinite(block)
        if not bool(finite.all()):
            nan += int(torch.isnan(block).sum())
            inf += int(torch.isinf(block).sum())
            block = block[finite]
        if block.numel():
            lo, hi = torch.aminmax(block)
            low = float(lo) if low is None else min(low, float(lo))
            high = float(hi) if high is None else max(high, float(hi))
            total += float(block.sum())
            sumsq += float(torch.dot(block, block))
    return total, sumsq, low, high, nan, inf


def _measure(tensor, hashed: bool) -> tuple[dict, str | None]:
    """TENSOR's fingerprint: order- and layout-invariant statistics in float64 (exact min / max),
    and if HASHED its k64 checksum (`digest`), from one pass over the tensor's memory on the CPU."""
    fp, checksum, _ = _measure_with_rows(tensor, hashed, None)
    return fp, checksum


def _measure_with_rows(tensor, hashed: bool, rows) -> tuple[dict, str | None, dict | None]:
    """`_measure`, and the fingerprint of elements [start, stop) of TENSOR from the same pass where
    ROWS is (start, stop) and TENSOR a contiguous CPU tensor (a TP rank's rows: `_received`); None
    for those otherwise."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return fingerprint(tensor), (digest(tensor) if hashed else None), None
    keyed = _Keyed(_header(tensor)) if hashed else None
    if rows is None or not tensor.is_contiguous():
        stats = _stats(_blocks(tensor, hashed), keyed)
        return _fp(tensor.numel(), stats), (None if keyed is None else keyed.result()), None
    flat, (start, stop) = tensor.detach().reshape(-1), rows
    ranges = [flat[a:b] for a, b in ((0, start), (start, stop), (stop, flat.numel()))]
    stats = [_stats(_blocks(r, hashed), keyed) if r.numel() else None for r in ranges]  # one k64 stream
    whole = _fp(tensor.numel(), _sum_stats(s for s in stats if s))
    return whole, (None if keyed is None else keyed.result()), _fp(stop - start, stats[1])


def _checksum_and_rows(tensor, rows) -> tuple[str, dict | None]:
    """TENSOR's k64 checksum and, where ROWS is (start, stop) (`_own_rows`: a contiguous CPU
    tensor), the fingerprint of elements [start, stop) from the same pass (only those measured)."""
    if rows is None:
        return digest(tensor), None
    keyed = _Keyed(_header(tensor))
    flat, (start, stop) = tensor.detach().reshape(-1), rows
    for piece in _pieces(flat[:start]):
        keyed.add(_raw(piece))
    own = _fp(stop - start, _stats(_blocks(flat[start:stop], True), keyed))
    for piece in _pieces(flat[stop:]):
        keyed.add(_raw(piece))
    return keyed.result(), own


def _sum_stats(parts):
    totals, sumsqs, lows, highs, nans, infs = zip(*parts)
    present_lows, present_highs = [x for x in lows if x is not None], [x for x in highs if x is not None]
    return (math.fsum(totals), math.fsum(sumsqs), min(present_lows, default=None),
            max(present_highs, default=None), sum(nans), sum(infs))  # fmt: skip


def _fp(count: int, stats) -> dict:
    total, sumsq, low, high, nan, inf = stats
    return {"count": count, "sum": total, "sumsq": sumsq, "min": low, "max": high, "nan": nan, "inf": inf}


def fingerprint(tensor) -> dict:
    """Order- and layout-invariant statistics of TENSOR in float64 (exact min / max), summed by
    numpy in float64 from cache-sized blocks of the tensor's memory (no float64 copy of it is made);
    on a GPU / NPU, where the tensor lives."""
    if tensor.numel() == 0:
        return {"count": 0, "sum": 0.0, "sumsq": 0.0, "min": None, "max": None, "nan": 0, "inf": 0}
    if tensor.device.type == "cpu":
        return _measure(tensor, hashed=False)[0]
    return _fp(tensor.numel(), _device_stats(tensor))


def _header(tensor) -> str:
    return f"{tensor.dtype}|{tuple(tensor.shape)}|"


def digest(tensor) -> str:
    """A bit-exact checksum of TENSOR's bytes, dtype and shape: "k64:" and 16 hex digits (a change
    within one 8-byte word is always caught; it guards transfers, it is no cryptographic hash)."""
    if tensor.device.type != "cpu":
        try:
            return _device_digest(tensor)
        except Exception:  # noqa: BLE001 - a device without one of these integer ops: on the host
            pass
    t = tensor.detach().cpu()
    keyed = _Keyed(_header(t))
    if t.numel():
        for piece in _pieces(t):
            keyed.add(_raw(piece))
    return keyed.result()


def _dtype_name(tensor) -> str:
    """The dtype as the records spell it ("float32", not "torch.float32")."""
    return str(tensor.dtype).removeprefix("torch.")


def _record(
    stage: str,
    sync: int,
    rank: int,
    name: str,
    tensor,
    index: int,
    hashed=None,
    measured=None,
    lazy=False,
    **extra,
) -> dict:
    """One JSON line; HASHED True / False adds "hash" (the k64 checksum, or null when switched off);
    MEASURED: (fingerprint, checksum) known already, nothing is measured (fingerprint None: the
    statistics not taken); LAZY: only the checksum is taken (`"fp": null`)."""
    fp, checksum = measured or ((None, digest(tensor)) if lazy else _measure(tensor, bool(hashed)))
    record = {
        "stage": stage,
        "sync": sync,
        "rank": rank,
        "index": index,
        "name": name,
        "dtype": _dtype_name(tensor),
        "shape": list(tensor.shape),
        "fp": fp,
    }
    if hashed is not None:
        record["hash"] = checksum
    record.update(extra)
    return record


def _write(stage: str, records: list[dict]) -> None:
    if not records:
        return
    folder = os.environ.get(ENV, "").strip()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{stage}-{socket.gethostname()}-{os.getpid()}.jsonl")
    with open(path, "a", encoding="utf-8") as out:
        out.write("".join(json.dumps(r, allow_nan=False, default=str) + "\n" for r in records))


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a rank is information only
        pass
    return int(os.environ.get("RANK", "0") or 0)


# ------------------------------------------------------------------------------ sent


def sent(stream, step=None):
    """Wrap the actor's per-tensor generator: each (name, tensor) is fingerprinted as it goes by."""
    if not enabled():
        return stream
    _counters["sent"] += 1
    return _sent(stream, _counters["sent"], step)


def _sent(stream, sync: int, step):
    rank, records, hashed, lazy = _rank(), [], _hash_wanted(), _lazy()
    try:
        for index, (name, tensor) in enumerate(stream):
            _outgoing.pop(name, None)
            with _never_breaks_the_sync("the sent fingerprint"):
                lazy_here = lazy and tensor.numel() > 0
                records.append(
                    _record("sent", sync, rank, name, tensor, index, hashed, lazy=lazy_here, step=step)
                )
                if records[-1].get("hash"):
                    _outgoing[name] = {"hash": records[-1]["hash"], "fp": records[-1]["fp"]}
            yield name, tensor
    finally:
        with _never_breaks_the_sync("writing the sent fingerprints"):
            _write("sent", records)


# ------------------------------------------------------------------------------ the bucket
# The sender's fingerprint of each tensor travels with it, in the bucket's own metadata (verl's
# BucketedWeightSender: one dict per tensor, pickled with the bucket), so that the receiver, which
# takes the k64 checksum of what it got, writes the sender's statistics where the checksums are
# equal (the same bytes, dtype and shape) instead of measuring them again (`_received`).

BUCKET_KEY = "rl_msprobe"  # the key added to a tensor's bucket metadata
_outgoing: dict[str, dict] = {}  # sender: name -> {hash, fp} of the tensor `sent` last fingerprinted
_incoming: dict[str, dict] = {}  # receiver: name -> {hash, fp} from the bucket that brought it
_bucket = {"settles": False}  # the receiver of the bucket now loading calls `settled()` after it
# receiver, TP 1: name -> (sync state, received tensor, carried {hash, fp}, index): a received record
# not yet written, settled by the resident check of the same name in this bucket or by `settled()`
_deferred: dict[str, tuple] = {}
_received_out: list[dict] = []  # received records settled, to be written by `settled()` / `_end`


def settled() -> None:
    """Receiver, after a bucket's callback returned (its tensors still valid): every received record
    of the bucket still deferred is checksummed and written now, as `_received` would have, and no
    reference to the bucket's buffer is kept."""
    if not enabled():
        _deferred.clear()
        return
    with _never_breaks_the_sync("the received fingerprints"):
        for name in list(_deferred):
            _settle_received(name, None)
    _deferred.clear()
    with _never_breaks_the_sync("writing the received fingerprints"):
        _flush_received()


def _flush_received() -> None:
    """Write the settled received records (`settled()`, or `_end` for what is left) and forget them."""
    _write("received", _received_out)
    _received_out.clear()


def _settle_received(name: str, resident_hash: str | None) -> None:
    """Write NAME's deferred received record. RESIDENT_HASH: the k64 of a resident part of the same
    dtype and shape; equal to the sender's, the received bytes were the sent ones (a tensor that
    arrives other than sent cannot leave the sent bytes where the engine holds it); else the
    received tensor is checksummed here (measured where it differs from the sender's)."""
    state, tensor, carried, index = _deferred.pop(name)
    if resident_hash is not None and resident_hash == carried["hash"]:
        fp, checksum, extra = (
            _copy(carried["fp"]),
            carried["hash"],
            {"same_as": "sent", "implied_by": "resident"},
        )
    elif carried["fp"] is None:  # lazy statistics: no resident part vouched for these bytes, measured
        (fp, checksum), extra = _measure(tensor, True), {}
    else:
        checksum = digest(tensor)
        if checksum == carried["hash"]:
            fp, extra = dict(carried["fp"]), {"same_as": "sent"}
        else:
            fp, extra = fingerprint(tensor), {}
    record = _record(
        "received",
        state["sync"],
        state["rank"],
        name,
        tensor,
        index,
        True,
        (fp, checksum),
        tp_size=1,
        **extra,
    )
    _received_out.append(record)
    state.setdefault("got", {})[name] = {k: record[k] for k in ("hash", "dtype", "shape", "fp")}


def _copy(fp):
    """A record's statistics to reuse in another record (None: not taken, lazy statistics)."""
    return None if fp is None else dict(fp)


def tag(meta, name) -> None:
    """Sender, after the bucket metadata of NAME is made: add its sent {hash, fp} to META."""
    if not enabled():
        return
    with _never_breaks_the_sync("tagging the bucket"):
        carried = _outgoing.pop(name, None)
        if carried is not None:
            meta[BUCKET_KEY] = carried


def arrived(metadata, settles: bool = False) -> None:
    """Receiver, as a bucket's metadata arrives: keep the sender's {hash, fp} of each tensor in it
    for `_received` (the same process: verl's receiver calls the extension's `_update_weights`).
    SETTLES: the receiver calls `settled()` once the bucket is loaded, before its buffer is reused,
    so the received checksums of this bucket may wait for the resident ones (`_deferred`)."""
    if not enabled():
        return
    _bucket["settles"] = settles
    with _never_breaks_the_sync("reading the bucket's fingerprints"):
        for name, meta in metadata["bucket_meta"].items():
            carried = meta.get(BUCKET_KEY) if isinstance(meta, dict) else None
            if isinstance(carried, dict) and carried.get("hash"):
                _incoming[name] = carried


# ------------------------------------------------------------------------------ engine side


def engine_sync(method):
    """Decorator for the worker extension's sync entry (`update_weights_from_ipc`): one sync
    per call; the resident fingerprints are written when it returns."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not enabled():
            return method(self, *args, **kwargs)
        state = None
        with _never_breaks_the_sync("starting a sync's fingerprints"):
            state = _begin(self)
        try:
            return method(self, *args, **kwargs)
        finally:
            if state is not None:
                with _never_breaks_the_sync("the resident fingerprints"):
                    _end(self, state)

    return wrapper


def received(worker, weights) -> None:
    """First line of `_update_weights`: fingerprint the bucket as it arrived, per TP rank."""
    if not enabled():
        return
    with _never_breaks_the_sync("the received fingerprints"):
        _received(_states.get(id(worker)) or _begin(worker), weights, defer=_bucket["settles"])


def _received(state: dict, weights, defer: bool = False) -> None:
    hashed, records = _hash_wanted(), []
    for name, tensor in weights:
        index, tp_size = state["index"], state["tp_size"]
        rank = state["rank"]
        carried, extra, rows = _incoming.pop(name, None), {}, _own_rows(tensor, rank, tp_size)
        waits = defer and hashed and carried is not None and tp_size == 1 and tensor.numel()
        if waits and tensor.device.type == "cpu" and name not in _deferred:  # `_settle_received`
            _deferred[name] = (state, tensor, carried, index)
            shape, dtype = list(tensor.shape), _dtype_name(tensor)
            got = {"hash": carried["hash"], "dtype": dtype, "shape": shape, "fp": carried["fp"]}
            state.setdefault("got", {})[name] = got
            state["index"] += 1
            continue
        if hashed and carried is not None and carried.get("fp") is not None and tensor.numel():
            checksum, own = _checksum_and_rows(tensor, rows)
            if checksum == carried["hash"]:  # the sender's bytes, dtype and shape: its statistics
                fp, extra = dict(carried["fp"]), {"same_as": "sent"}
            else:  # other bytes than were sent: measured
                fp, _, own = _measure_with_rows(tensor, False, rows)
        else:
            fp, checksum, own = _measure_with_rows(tensor, hashed, rows)
        measured = (fp, checksum)
        record = _record(
            "received", state["sync"], rank, name, tensor, index, hashed, measured, tp_size=tp_size, **extra
        )
        if tp_size > 1:
            # dim 0's chunk where the pass over the whole tensor measured it
            shards = _own_shards(tensor, rank, tp_size, skip=(0,) if own else ())
            if own:
                shards["0"] = own
            record["shard_fp"] = dict(sorted(shards.items()))
        records.append(record)
        if record.get("hash"):
            keep = {k: record[k] for k in ("hash", "dtype", "shape", "fp")}
            state.setdefault("got", {})[name] = keep  # what `_resident_record` may reuse
        state["index"] += 1
    _write("received", records)


def _own_rows(tensor, rank: int, tp_size: int):
    """(start, stop): the elements of this TP rank's chunk along dim 0 of a contiguous TENSOR in
    row-major order (its `shard_fp` "0", measured in the pass over the whole tensor); None where
    there is none to take (TP 1, no equal chunks, a strided tensor)."""
    if tp_size < 2 or rank >= tp_size or tensor.dim() < 1 or tensor.shape[0] % tp_size:
        return None
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    size = tensor.numel() // tp_size
    return rank * size, (rank + 1) * size


def _own_shards(tensor, rank: int, tp_size: int, skip=()) -> dict[str, dict]:
    """This TP rank's part of a received TENSOR as a tensor-parallel layer takes it (its RANK-th of
    TP_SIZE equal chunks along dim 0, column-parallel, and along dim 1, row-parallel): what its
    resident shard must match, so a loader fault on one rank names that rank. SKIP: dims measured
    elsewhere (dim 0 in the pass over the whole tensor, `_own_rows`)."""
    shards = {}
    for dim in range(min(tensor.dim(), 2)):
        if dim not in skip and tensor.shape[dim] % tp_size == 0 and rank < tp_size:
            shards[str(dim)] = fingerprint(tensor.chunk(tp_size, dim)[rank])
    return shards


# An engine that loads one sync in several calls, one per bucket (SGLang's ModelRunner /
# WeightUpdater `update_weights_from_tensor`): each call is fingerprinted as it arrives
# (`call_received`) and, when the call returns (`engine_call`), each tensor it carried where the
# model now holds it. A call that brings a name this sync has already seen starts the next sync.


def engine_call(method):
    """Decorator for an engine's per-bucket update entry: the parameters its received tensors went
    into are fingerprinted (stage resident) when it returns."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not enabled():
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        finally:
            state = _states.get(id(self))
            if state is not None and state["pending"]:
                with _never_breaks_the_sync("the resident fingerprints"):
                    _settle(self, state)

    return wrapper


def call_received(engine, weights) -> None:
    """In the update entry, after the tensors are unpacked and before the model loads them."""
    if not enabled():
        return
    with _never_breaks_the_sync("the received fingerprints"):
        names = [name for name, _ in weights]
        state = _states.get(id(engine))
        if state is None or not state["seen"].isdisjoint(names) or len(set(names)) < len(names):
            state = _begin(engine, armed=False)
        state["seen"].update(names)
        state["pending"].update(names)
        _received(state, weights)


def _settle(engine, state: dict) -> None:
    """Resident fingerprints of what this call loaded, and the sync's meta line (every name the
    model holds, so that a tensor never sent is missing, not silently skipped)."""
    model = _model(engine)
    pending, state["pending"] = state["pending"], set()
    if model is None:
        return
    aliases = _aliases(model)
    records, holds = [], []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if full in aliases or getattr(param, "is_meta", False):
                continue
            base = dict(how="parameter", tp_size=state["tp_size"], engine_name=full)
            for name, part in _parts(model, module_name, module, pname, param):
                holds.append(name)
                if name in pending:
                    records.append(_resident_record(state, name, part, base))
    records.append({**_meta(model, state, aliases), "holds": holds})
    _write("resident", records)


_states: dict[int, dict] = {}  # id(engine object) -> its sync in progress (some are frozen dataclasses)


def _tp() -> tuple[int, int]:
    """(TP rank, TP size) from the parallel state of the engine running in this process."""
    for module in ("vllm.distributed.parallel_state", "sglang.srt.distributed.parallel_state"):
        parallel = sys.modules.get(module)
        if parallel is None:
            continue
        try:
            return parallel.get_tensor_model_parallel_rank(), parallel.get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - imported but not initialised here
            continue
    return _rank(), 1


def _model(worker):
    """The engine's model: vLLM's worker extension `model_runner.model`, SGLang's ModelRunner
    `model`, SGLang's WeightUpdater `get_model()`."""
    for owner in (getattr(worker, "model_runner", None), worker):
        model = getattr(owner, "model", None) if owner is not None else None
        if model is not None:
            return model
    get = getattr(worker, "get_model", None)
    return get() if callable(get) else None


def _begin(worker, armed: bool = True) -> dict:
    _counters["engine"] += 1
    rank, tp_size = _tp()
    state = {"sync": _counters["engine"], "rank": rank, "tp_size": tp_size, "index": 0, "captured": set(),
             "seen": set(), "pending": set(), "got": {}}  # fmt: skip
    _states[id(worker)] = state
    model = _model(worker)
    if model is not None:  # a reset sync with no forward since: checked now
        _reset_check(model)
    if model is not None and state["sync"] in _reset_syncs():
        with _never_breaks_the_sync("reset mode's fill"):
            _reset(model)
            state["reset"] = True
    if model is not None and armed:
        _arm(model, state)
    return state


# id(model) -> (the reset sync, its rank, its TP size, the forward pre-hook's handle): checked at the
# model's first forward after that sync, or at the next sync's start where no forward came between
_after_reset: dict[int, tuple[int, int, int, object]] = {}


def _await_reset_check(model, state: dict) -> None:
    """After a reset sync: check at the model's first forward (the rollout's first step), not at the
    sync's end, since an engine may put back what it was not given only after the sync returns
    (vLLM's layer-by-layer reload); the next sync's start checks where no hook ran (a compiled
    forward)."""

    def check_before_forward(module, args):
        _reset_check(module)

    handle = model.register_forward_pre_hook(check_before_forward)
    _after_reset[id(model)] = (state["sync"], state["rank"], state["tp_size"], handle)


def _reset_check(model) -> None:
    pending = _after_reset.pop(id(model), None)
    if pending is None:
        return
    sync, rank, tp_size, handle = pending
    handle.remove()
    with _never_breaks_the_sync("reset mode's check"):
        _check_reset(model, sync, rank, tp_size)


def _check_reset(model, sync: int, rank: int, tp_size: int) -> None:
    """The HF parts still holding the pattern after reset sync SYNC, in a meta line of that sync."""
    kept = [
        name
        for module_name, module in model.named_modules()
        for pname, param in module.named_parameters(recurse=False)
        if not getattr(param, "is_meta", False) and param.numel()
        for name, part in _parts(model, module_name, module, pname, param)
        if _holds_pattern(part)
    ]
    line = {"stage": "resident-meta", "sync": sync, "rank": rank, "tp_size": tp_size}
    _write("resident", [{**line, "format": FORMAT, "reset_kept": kept}])


def _reset_syncs() -> set[int]:
    """The syncs RL_MSPROBE_WEIGHTS_RESET names ("1", "3,5"); empty when unset or unreadable."""
    text = os.environ.get(RESET_ENV, "").strip()
    return {int(x) for x in text.split(",") if x.strip().isdigit()}


def _reset(model) -> None:
    """Reset mode: every floating parameter filled with PATTERN before the sync writes the weights,
    and the tensors set aside for a layer whose parameters an engine has put on meta to reload it."""
    import torch

    # inference mode: vLLM creates its parameters as inference tensors, which refuse an in-place
    # update outside it (a normal tensor takes one inside it as well)
    with torch.inference_mode():
        for module in model.modules():
            for param in [*module.parameters(recurse=False), *_set_aside(module)]:
                if param.numel() and param.is_floating_point() and not param.is_meta:
                    try:
                        param.data.fill_(PATTERN)
                    except Exception:  # noqa: BLE001 - an opaque (repacked) weight: left as it is, never named
                        continue


def _set_aside(module) -> list:
    """The parameters an engine reloading layer by layer keeps aside while MODULE's are on meta, and
    puts back for a layer the sync never loaded (vLLM's model_loader.reload: a layer's
    `kernel_tensors`, where the reload copies what it loads); none for any other engine."""
    layerwise = sys.modules.get("vllm.model_executor.model_loader.reload.layerwise")
    infos = getattr(layerwise, "LAYERWISE_INFO", None)
    try:
        info = infos.get(module) if infos is not None else None
    except TypeError:  # an unhashable module: not one the reload tracks
        return []
    kernel = getattr(info, "kernel_tensors", None)
    params = kernel[0] if isinstance(kernel, tuple) and kernel and isinstance(kernel[0], dict) else {}
    return [t for t in params.values() if hasattr(t, "is_floating_point")]


def _holds_pattern(part) -> bool:
    """Does this part of a parameter still hold reset mode's PATTERN everywhere?"""
    import torch

    t = part.detach()
    if not t.numel() or not t.is_floating_point():
        return False
    return bool((t == torch.tensor(PATTERN, dtype=t.dtype, device=t.device)).all())


def _end(worker, state: dict) -> None:
    _states.pop(id(worker), None)
    stale = [name for name, entry in _deferred.items() if entry[0] is state]
    if stale:  # a receiver that never called `settled()`: those tensors may be gone, not guessed
        for name in stale:
            del _deferred[name]
        with _never_breaks_the_sync("received records never settled"):
            raise RuntimeError(f"{len(stale)} received records not settled by the receiver ({stale[0]}, ...)")
    _flush_received()
    model = _model(worker)
    if model is None:
        return
    records = []
    aliases = _aliases(model)
    unwritten = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if full in aliases or full in state["captured"]:
                continue
            if getattr(param, "is_meta", False):
                # not loaded when the sync returned (an engine that reloads layer by layer keeps the
                # old value of what it was not given); a layer processed later is captured then
                unwritten += [name for name, _ in _parts(model, module_name, module, pname, param)]
                continue
            state["captured"].add(full)
            records.extend(_resident(model, module_name, module, pname, param, state, "parameter"))
    records.append({**_meta(model, state, aliases), "unwritten": unwritten})
    if state.get("reset"):
        _await_reset_check(model, state)
    _write("resident", records)


def _aliases(model) -> dict[str, str]:
    """Parameters the model holds under two names (tied embeddings): second name -> first."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _meta(model, state: dict, aliases: dict[str, str]) -> dict:
    return {
        "stage": "resident-meta",
        "sync": state["sync"],
        "rank": state["rank"],
        "tp_size": state["tp_size"],
        "format": FORMAT,
        "aliases": aliases,
        "packed": _packed(model),
        "model": type(model).__name__,
    }


def _packed(model) -> dict[str, list[str]]:
    """Fused module -> its HF parts in order: vLLM's `packed_modules_mapping`; SGLang models that
    lack it say the same in `bitsandbytes_stacked_params_mapping` (part -> (fused, index)) or in
    `stacked_params_mapping` ((fused, part, shard id) rows)."""
    mapping = getattr(model, "packed_modules_mapping", None)
    if mapping:
        return {k: list(v) for k, v in mapping.items()}
    rows = []
    stacked = getattr(model, "bitsandbytes_stacked_params_mapping", None)
    if isinstance(stacked, dict):
        rows = [(fused, part, index) for part, (fused, index) in stacked.items()]
    elif isinstance(getattr(model, "stacked_params_mapping", None), (list, tuple)):
        rows = [tuple(row[:3]) for row in model.stacked_params_mapping if len(row) >= 3]
    order = {"q": 0, "k": 1, "v": 2}
    packed: dict[str, list] = {}
    for fused, part, index in rows:
        packed.setdefault(str(fused).strip("."), []).append((order.get(index, index), str(part).strip(".")))
    return {k: [part for _, part in sorted(v, key=lambda p: str(p[0]))] for k, v in packed.items()}


def _arm(model, state: dict) -> None:
    """Fingerprint each layer just before its weights are processed (repacked) after loading."""
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is None:
            continue
        armed = getattr(method, "_rl_msprobe_armed", None)
        if armed is None:
            armed = {}
            method._rl_msprobe_armed = armed
            original = process

            def hooked(layer, *args, _original=original, _armed=armed, **kwargs):
                entry = _armed.get(id(layer))
                if entry is not None and enabled():
                    with _never_breaks_the_sync("the loader-written fingerprints"):
                        _capture(*entry, layer)
                return _original(layer, *args, **kwargs)

            method.process_weights_after_loading = hooked
        armed[id(module)] = (model, module_name, state)


def _capture(model, module_name: str, state: dict, layer) -> None:
    records = []
    for pname, param in layer.named_parameters(recurse=False):
        full = f"{module_name}.{pname}" if module_name else pname
        if full in state["captured"] or getattr(param, "is_meta", False) or param.numel() == 0:
            continue
        state["captured"].add(full)
        records.extend(_resident(model, module_name, layer, pname, param, state, "loader-written"))
    _write("resident", records)


def _resident(model, module_name: str, module, pname: str, param, state: dict, how: str) -> list[dict]:
    """One record per HF tensor this parameter holds: fused parts split, vocab padding dropped."""
    base = dict(how=how, tp_size=state["tp_size"], engine_name=f"{module_name}.{pname}".lstrip("."))
    if param.numel() == 0:
        name = base["engine_name"]
        return [_record("resident", state["sync"], state["rank"], name, param, -1, unreadable=True, **base)]
    return [
        _resident_record(state, name, part, base)
        for name, part in _parts(model, module_name, module, pname, param)
    ]


def _resident_record(state: dict, name: str, part, base: dict) -> dict:
    """The resident record of one HF part. Where this process received the tensor under that name in
    this sync with the same dtype and shape (TP 1, a replicated copy; never a TP shard), the part's
    k64 checksum is taken first: equal to the received one, its bytes are the received bytes, so
    are its statistics, and the record reuses them (`"same_as": "received"`, ~1/3 of the cost of
    measuring). Otherwise (no hash received, another layout, a GPU / NPU tensor, different bytes:
    a loader fault) the statistics are measured as for any part; the checksum, taken, is kept."""
    if state.get("reset"):
        base = dict(base, reset_kept=_holds_pattern(part))
    got = state.get("got", {}).get(name)
    comparable = (
        got is not None
        and part.device.type == "cpu"
        and part.numel() > 0
        and _dtype_name(part) == got["dtype"]
        and list(part.shape) == got["shape"]
    )
    if not comparable:
        return _record("resident", state["sync"], state["rank"], name, part, -1, **base)
    # lazy statistics: a process's first sync measures every part (what `--checkpoint` compares)
    fp, checksum = _measure(part, True) if got["fp"] is None and state["sync"] == 1 else (None, digest(part))
    if name in _deferred and _deferred[name][0] is state:  # its received record waits for this check
        _settle_received(name, checksum)
        got = state["got"][name]
    if checksum == got["hash"] and fp is None:
        measured, base = (_copy(got["fp"]), checksum), dict(base, same_as="received")
    else:
        measured = (fp or fingerprint(part), checksum)
    return _record("resident", state["sync"], state["rank"], name, part, -1, True, measured=measured, **base)


# A fused-MoE layer (vLLM's FusedMoE / RoutedExperts, SGLang's FusedMoE) holds all its experts
# stacked in two 3-D parameters: `w13_weight` [E, 2I, H] (each expert's gate rows, then its up rows,
# as the loader's shards "w1" / "w3" write them) and `w2_weight` [E, H, I] (down), I this TP rank's
# share. Split back into the per-expert tensors the trainer sends (`experts.{e}.gate_proj.weight`
# ...), so that a fault names the layer, the expert and the projection.
EXPERT_PARAMS = {
    "w13_weight": ("ckpt_gate_proj_name", "ckpt_up_proj_name"),
    "w2_weight": ("ckpt_down_proj_name",),
}
EXPERT_NAMES = {
    "ckpt_gate_proj_name": "gate_proj",
    "ckpt_up_proj_name": "up_proj",
    "ckpt_down_proj_name": "down_proj",
}


def _expert_parts(module_name: str, module, pname: str, tensor):
    """The per-expert HF parts of a stacked expert parameter; None for any other parameter. The HF
    prefix is the layer's `layer_name` where the module sits under it (vLLM 0.32's
    `experts.routed_experts`), else the module's own name; the projection names are the layer's
    checkpoint names (`ckpt_*_proj_name`: Mixtral's w1 / w3 / w2); a non-gated layer's w13 is one
    projection; under expert parallelism `expert_map` (global -> local, -1: elsewhere) says which
    global experts this rank holds."""
    keys = EXPERT_PARAMS.get(pname)
    if keys is None or tensor.dim() != 3:
        return None
    config = getattr(module, "moe_config", None)
    if len(keys) == 2 and getattr(config, "is_act_and_mul", True) is False:
        keys = keys[:1]
    projections = [getattr(module, key, None) or EXPERT_NAMES[key] for key in keys]
    if tensor.shape[1] % len(projections):
        return None
    layer_name = getattr(module, "layer_name", None)
    under = isinstance(layer_name, str) and module_name.startswith(layer_name + ".")
    prefix = layer_name if under else module_name
    try:
        expert_map = getattr(module, "expert_map", None)
    except Exception:  # noqa: BLE001 - a property that needs a kernel: no expert parallelism known
        expert_map = None
    if expert_map is not None and hasattr(expert_map, "tolist"):
        local_of = expert_map.tolist()
        held = sorted((local, g) for g, local in enumerate(local_of) if 0 <= local < tensor.shape[0])
    else:
        held = [(e, e) for e in range(tensor.shape[0])]
    size = tensor.shape[1] // len(projections)
    return [
        (f"{prefix}.{expert}.{projection}.weight", tensor[local].narrow(0, i * size, size))
        for local, expert in held
        for i, projection in enumerate(projections)
    ]


def _parts(model, module_name: str, module, pname: str, param):
    tensor = param.detach()
    experts = _expert_parts(module_name, module, pname, tensor)
    if experts is not None:
        yield from experts
        return
    prefix, _, short = module_name.rpartition(".")
    packed = _packed(model).get(short)
    sizes = list(getattr(module, "output_partition_sizes", None) or [])
    dim = getattr(param, "output_dim", 0)
    if packed and len(packed) == len(sizes) and tensor.dim() > dim and tensor.shape[dim] == sum(sizes):
        offset = 0
        for part, size in zip(packed, sizes):
            name = f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}"
            yield name, tensor.narrow(dim, offset, size)
            offset += size
        return
    indices = getattr(module, "shard_indices", None)
    rows = getattr(indices, "num_org_elements", None)
    name = f"{module_name}.{pname}" if module_name else pname
    if isinstance(rows, int) and tensor.dim() >= 1 and tensor.shape[0] > rows:
        tensor = tensor.narrow(0, 0, rows)  # padded vocab rows: nothing was loaded there
    yield name, tensor

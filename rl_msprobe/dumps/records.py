"""Reading the per-token records both sides write (docs/records.md, `rl-msprobe-records/1`).

`DIR/{rollout,train}/{pid}/rec{K}.json` (the header, written last) and `rec{K}.f32` (float32:
Max[rows], Min[rows], Norm[rows] of each tensor in the header's order). Every header is checked
against the format and every `.f32` against the size its header gives; a record without its
`.json` is unfinished and is skipped, counted (`SideRecords.unfinished`). What cannot be read is a
UserError naming the file and the field; values that are not finite numbers, negative norms and a
Max below its Min are the request's problem (NOT COMPARED naming the file, tensor and position),
never dropped. The arrays are read with numpy, whole blocks at a time.

`read_side` gathers one side's records per request: for each tensor (module key, label), in the
order the forwards first gave them, and each TP rank, a [3, positions] array (Max, Min, Norm;
NaN where that rank recorded no row at that position). Rows of the sample kind (vLLM's logits: one
row per sampled request) land at their positions like token rows. Several SP ranks (Ulysses) give
disjoint positions of one request and so are put side by side by position.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import bounded
from rl_msprobe.errors import UserError

FORMAT = "rl-msprobe-records/1"
SIDES = ("rollout", "train")
_RECORD = re.compile(r"^rec(\d+)\.(json|f32)$")
_KEY = re.compile(r"^Module\..+\.[A-Za-z_][A-Za-z0-9_]*\.forward\.\d+$")
_LABEL = re.compile(r"^(input|output)\.\d+$")
MAX_POSITION = 10_000_000  # far beyond a real sequence
MAX_RANK = 65_536
Array = Any  # numpy arrays (numpy is imported where used)


@dataclass(frozen=True)
class Tensor:
    key: str
    label: str
    dtype: str
    width: int
    rows: str  # token | sample
    offset: int


@dataclass(frozen=True)
class Header:
    path: Path  # the .json
    side: str
    pid: int
    forward: int
    tp_rank: int
    tp_size: int
    phase: str
    requests: tuple[str, ...]
    token_rows: tuple[tuple[int, int, int], ...]
    sample_rows: tuple[tuple[int, int], ...]
    tensors: tuple[Tensor, ...]

    @property
    def data(self) -> Path:
        return self.path.with_suffix(".f32")

    @property
    def floats(self) -> int:
        return sum(3 * self.count(t.rows) for t in self.tensors)

    def count(self, kind: str) -> int:
        return sum(c for _, _, c in self.token_rows) if kind == "token" else len(self.sample_rows)


def _int(doc: dict[str, Any], name: str, path: Path, limit: int, default: int | None = None) -> int:
    value = doc.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{path}: `{name}` is {value!r}, not an integer; {_NOT_OURS}")
    return bounded.bounded_int(value, limit, str(path), f"`{name}`")


_NOT_OURS = "not a record rl-msprobe's helper wrote (docs/records.md); remove it or re-run the job."


def _rows(value: object, path: Path, name: str, width: int, requests: int) -> list[tuple[int, ...]]:
    if not isinstance(value, list):
        raise UserError(f"{path}: `{name}` is not a list; {_NOT_OURS}")
    out = []
    for n, row in enumerate(value):
        if (
            not isinstance(row, list)
            or len(row) != width
            or any(not isinstance(x, int) or isinstance(x, bool) for x in row)
        ):
            raise UserError(f"{path}: `{name}[{n}]` is {str(row)[:80]}, not {width} integers; {_NOT_OURS}")
        where = f"{path}: `{name}[{n}]`"
        bounded.bounded_int(row[0], requests - 1, where, "request index")
        bounded.bounded_int(row[1], MAX_POSITION, where, "position")
        if width == 3 and not 1 <= row[2] <= MAX_POSITION:
            raise UserError(f"{where}: row count {row[2]} is not a positive count; {_NOT_OURS}")
        out.append(tuple(row))
    return out


_Row = tuple[str, str, str, int, str, "int | None"]
_SCHEMAS: dict[tuple[str, int, int, int], list[_Row]] = {}  # (file, size, mtime, number) -> its table


def _schema(folder: Path, number: int, record: Path) -> list[_Row]:
    """The tensor table `schema{NUMBER}.json` beside a record (the writer's one copy per process and
    table), read once and kept while the file is unchanged."""
    path = folder / f"schema{number}.json"
    try:
        info = path.stat()
    except OSError as exc:
        raise UserError(
            f"{record}: its tensor table {path.name} cannot be read ({exc.strerror}); the record set is "
            "incomplete: copy the whole records folder, or re-run the job."
        ) from None
    key = (str(path), info.st_size, info.st_mtime_ns, number)
    table = _SCHEMAS.get(key)
    if table is None:
        try:
            doc = json.loads(bounded.read_bytes(path, "record tensor table", bounded.CONFIG))
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deeply; {_NOT_OURS}") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"{path}: not JSON ({exc}); {_NOT_OURS}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("schema") != number:
            raise UserError(f"{path}: not tensor table {number} of {FORMAT}; {_NOT_OURS}")
        table = _table(doc.get("tensors"), f"{path}: `tensors`", path, offsets=False)
        _SCHEMAS[key] = table
    return table


def _table(raw: object, where: str, path: Path, *, offsets: bool) -> list[_Row]:
    """A tensor table checked entry by entry: (key, label, dtype, width, rows, offset or None)."""
    if not isinstance(raw, list):
        raise UserError(f"{where} is not a list; {_NOT_OURS}")
    out: list[_Row] = []
    for n, t in enumerate(raw):
        at = f"{where}[{n}]"
        if not isinstance(t, dict):
            raise UserError(f"{at} is not an object; {_NOT_OURS}")
        key, label, dtype, rows = t.get("key"), t.get("label"), t.get("dtype"), t.get("rows")
        if not isinstance(key, str) or not _KEY.match(key):
            raise UserError(
                f"{at}: `key` {str(key)[:80]!r} is not Module.<name>.<class>.forward.<n>; {_NOT_OURS}"
            )
        if not isinstance(label, str) or not _LABEL.match(label):
            raise UserError(f"{at}: `label` {str(label)[:40]!r} is not input.N / output.N; {_NOT_OURS}")
        if not isinstance(dtype, str) or rows not in ("token", "sample"):
            raise UserError(f"{at}: `dtype` or `rows` ({str(rows)[:20]!r}) is not the format's; {_NOT_OURS}")
        width = _int(t, "width", Path(at), 1 << 40)
        if width < 1:
            raise UserError(f"{at}: `width` 0; {_NOT_OURS}")
        given = _int(t, "offset", Path(at), 1 << 40) if offsets else None
        out.append((key, label, dtype, width, str(rows), given))
    return out


def read_header(path: Path, side: str) -> Header:
    """One record's header, checked field by field (module doc); UserError naming the field."""
    try:
        doc = json.loads(bounded.read_bytes(path, "record header", bounded.CONFIG))
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply; {_NOT_OURS}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not JSON ({exc}); {_NOT_OURS}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a JSON object; {_NOT_OURS}")
    if doc.get("format") != FORMAT:
        raise UserError(f"{path}: `format` is {str(doc.get('format'))[:60]!r}, not {FORMAT!r}; {_NOT_OURS}")
    if doc.get("side") != side:
        raise UserError(f"{path}: `side` is {str(doc.get('side'))[:40]!r} in the {side} folder; {_NOT_OURS}")
    requests = doc.get("requests")
    if not isinstance(requests, list) or not all(isinstance(r, str) and r for r in requests):
        raise UserError(f"{path}: `requests` is not a list of request ids; {_NOT_OURS}")
    token_rows = _rows(doc.get("token_rows"), path, "token_rows", 3, len(requests))
    sample_rows = _rows(doc.get("sample_rows", []), path, "sample_rows", 2, len(requests))
    tp_size = _int(doc, "tp_size", path, MAX_RANK, 1)
    tp_rank = _int(doc, "tp_rank", path, MAX_RANK, 0)
    if tp_size < 1 or tp_rank >= tp_size:
        raise UserError(f"{path}: `tp_rank` {tp_rank} of `tp_size` {tp_size}; {_NOT_OURS}")
    counts = {"token": sum(c for _, _, c in token_rows), "sample": len(sample_rows)}
    if "schema" in doc:
        table = _schema(path.parent, _int(doc, "schema", path, 1 << 20), path)
    else:  # the table inline, each tensor with its offset
        table = _table(doc.get("tensors"), f"{path}: `tensors`", path, offsets=True)
    tensors, offset = [], 0
    for key, label, dtype, width, rows, given in table:
        if given is not None and given != offset:
            raise UserError(
                f"{path}: `{key}` {label}: `offset` {given} where the tensors before it end at {offset}; {_NOT_OURS}"
            )
        tensors.append(Tensor(key, label, dtype, width, rows, offset))
        offset += 3 * counts[rows]
    return Header(
        path,
        side,
        _int(doc, "pid", path, 1 << 31, 0),
        _int(doc, "forward", path, 1 << 40, 0),
        tp_rank,
        tp_size,
        str(doc.get("phase") or ""),
        tuple(requests),
        tuple((a, b, c) for a, b, c in token_rows),
        tuple((a, b) for a, b in sample_rows),
        tuple(tensors),
    )


def read_values(header: Header) -> Array:
    """The record's floats (the `.f32`), exactly as many as its header gives (UserError otherwise)."""
    import numpy as np

    path, want = header.data, header.floats
    info = bounded.regular(path, "record data (.f32)")
    if info.st_size != 4 * want:
        raise UserError(
            f"{path}: {info.st_size:,} bytes where its header {header.path.name} gives {want:,} float32 "
            f"({4 * want:,} bytes): the record is cut short or damaged; remove rec{header.forward}.* or re-run."
        )
    with bounded.open_regular(path, "record data (.f32)", 4 * want) as handle:
        try:
            values = np.fromfile(handle, dtype="<f4", count=want)
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: cannot be read ({exc}).") from None
    if values.size != want:
        raise UserError(f"{path}: {values.size} float32 read where the header gives {want}: cut short.")
    return values


# ------------------------------------------------------------------ finding the records
def _side_dirs(path: Path) -> dict[str, Path]:
    """{side: folder of pid folders} when PATH is a records root, or one side's folder."""
    if path.name in SIDES and _has_records(path):
        return {path.name: path}
    return {s: path / s for s in SIDES if (path / s).is_dir() and _has_records(path / s)}


def _has_records(side: Path) -> bool:
    try:
        return any(
            _RECORD.match(f.name) for pid in os.scandir(side) if pid.is_dir() for f in os.scandir(pid.path)
        )
    except OSError as exc:
        raise UserError(f"{side}: cannot be listed ({exc.strerror}); make it readable.") from None


def find(paths: list[Path]) -> dict[str, Path] | None:
    """The records' side folders ({"rollout": ..., "train": ...}, one or both) under PATHS: each a
    records root (RL_MSPROBE_RECORD_DIR), its parent dump folder, or one side's folder; None when
    none of them holds records."""
    found: dict[str, Path] = {}
    for path in paths:
        sides = _side_dirs(path)
        if not sides and path.is_dir():
            try:
                children = sorted(c for c in path.iterdir() if c.is_dir() and not c.is_symlink())
            except OSError as exc:
                raise UserError(f"{path}: cannot be listed ({exc.strerror}).") from None
            for child in children:
                sides = _side_dirs(child)
                if sides:
                    break
        for side, folder in sides.items():
            if side in found and found[side] != folder:
                raise UserError(
                    f"records of the {side} side in two places ({found[side]}, {folder}); pass one."
                )
            found[side] = folder
    return found or None


@dataclass
class Listing:
    headers: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)  # .f32 without its .json (or a .json.tmp)
    orphans: list[Path] = field(default_factory=list)  # .json without its .f32
    bytes: int = 0


def list_side(folder: Path) -> Listing:
    """Every record of one side, each process's in the order it wrote them."""
    out = Listing()
    try:
        pids = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.name)
    except OSError as exc:
        raise UserError(f"{folder}: cannot be listed ({exc.strerror}); make it readable.") from None
    for pid in pids:
        try:
            names = os.listdir(pid)
        except OSError as exc:
            raise UserError(f"{pid}: cannot be listed ({exc.strerror}); make it readable.") from None
        found: dict[int, set[str]] = {}
        for name in names:
            m = _RECORD.match(name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
                try:
                    out.bytes += os.stat(pid / name).st_size
                except OSError as exc:
                    raise UserError(f"{pid / name}: cannot be read ({exc.strerror}).") from None
            elif name.startswith("schema") and name.endswith(".json"):  # the records' tensor tables
                try:
                    out.bytes += os.stat(pid / name).st_size
                except OSError as exc:
                    raise UserError(f"{pid / name}: cannot be read ({exc.strerror}).") from None
            elif name.endswith(".json.tmp"):
                out.unfinished.append(pid / name)
        for k in sorted(found):
            kinds = found[k]
            if "json" not in kinds:
                out.unfinished.append(pid / f"rec{k}.f32")
            elif "f32" not in kinds:
                out.orphans.append(pid / f"rec{k}.json")
            else:
                out.headers.append(pid / f"rec{k}.json")
    return out


# ------------------------------------------------------------------ one side per request
@dataclass
class RequestRows:
    """One request's rows on one side: per TP rank, chunks (tensor indices, positions, [k, 3, n])."""

    chunks: dict[int, list[tuple[Array, Array, Array]]] = field(default_factory=dict)
    tp_size: set[int] = field(default_factory=set)
    prompt: int = 0  # rows of prefill: the end of the last segment of a prefill forward or of > 1 row
    problems: list[str] = field(default_factory=list)  # values that are not numbers: why NOT COMPARED
    files: set[Path] = field(default_factory=set)

    def arrays(self, tensors: int) -> tuple[dict[int, Array], int]:
        """({TP rank: [tensors, 3, positions] float64, NaN where not recorded}, repeated rows)."""
        import numpy as np

        length = 1 + max(
            (int(pos.max()) for chunks in self.chunks.values() for _, pos, _ in chunks if pos.size),
            default=-1,
        )
        out, repeated = {}, 0
        for rank, chunks in sorted(self.chunks.items()):
            a = np.full((tensors, 3, length), np.nan)
            for index, pos, block in chunks:
                cells = np.ix_(index, np.arange(3), pos)
                seen = ~np.isnan(a[cells])
                if seen.any():  # a row recorded again (a recomputed forward): the first is kept, counted
                    repeated += int(seen[:, 0, :].sum())
                    block = np.where(seen, a[cells], block)
                a[cells] = block
            out[rank] = a
        return out, repeated


@dataclass
class SideRecords:
    """One side's records (module doc): the tensors in forward order and each request's rows."""

    side: str
    folder: Path
    tensors: list[tuple[str, str]] = field(default_factory=list)  # (key, label)
    dtypes: list[str] = field(default_factory=list)
    widths: list[dict[int, int]] = field(default_factory=list)  # per tensor: TP rank -> width
    odd_widths: dict[int, str] = field(default_factory=dict)  # tensor -> why its width is not one
    requests: dict[str, RequestRows] = field(default_factory=dict)
    records: int = 0
    unfinished: int = 0
    bytes: int = 0

    def index_of(self, t: Tensor, rank: int, where: Path) -> int:
        key = (t.key, t.label)
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.tensors)
            self.tensors.append(key)
            self.dtypes.append(t.dtype)
            self.widths.append({})
        known = self.widths[i].setdefault(rank, t.width)
        if known != t.width and i not in self.odd_widths:
            self.odd_widths[i] = (
                f"its row width changes between forwards ({known}, {t.width} in {where.name})"
            )
        return i

    def __post_init__(self) -> None:
        self._index: dict[tuple[str, str], int] = {}


def _segments(header: Header, kind: str) -> tuple[Array, Array]:
    """(request index, position) of each row of KIND, in record order."""
    import numpy as np

    if kind == "sample":
        rows = np.array(header.sample_rows, dtype=np.int64).reshape(-1, 2)
        return rows[:, 0], rows[:, 1]
    tr = np.array(header.token_rows, dtype=np.int64).reshape(-1, 3)
    counts = tr[:, 2]
    req = np.repeat(tr[:, 0], counts)
    starts = np.repeat(tr[:, 1] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return req, starts + np.arange(int(counts.sum()))


def _check_block(block: Array, header: Header, tensors: list[Tensor], pos: Array, rid: str) -> str | None:
    """Why BLOCK ([tensors, 3, rows]) cannot be judged, naming file, tensor and position; None if fine."""
    import numpy as np

    bad = ~np.isfinite(block)
    what = "not a finite number"
    if not bad.any():
        bad = np.zeros_like(bad)
        bad[:, 2, :] = block[:, 2, :] < 0
        what = "a negative norm"
        if not bad.any():
            bad[:, 0, :] = block[:, 0, :] < block[:, 1, :]
            what = "a Max below its Min"
            if not bad.any():
                return None
    t, stat, row = (int(x[0]) for x in np.nonzero(bad))
    tensor = tensors[t]
    return (
        f"{header.data}: {tensor.key} {tensor.label} {('Max', 'Min', 'Norm')[stat]} at position {int(pos[row])} "
        f"of request {rid} is {what} ({block[t, stat, row]!r}): the forward produced it or the record is damaged"
    )


def add_record(side: SideRecords, header: Header, values: Array) -> None:
    """Put one record's rows under their requests (module doc)."""
    import numpy as np

    for kind in ("token", "sample"):
        tensors = [t for t in header.tensors if t.rows == kind]
        n = header.count(kind)
        if not tensors or not n:
            continue
        req, pos = _segments(header, kind)
        index = np.array([side.index_of(t, header.tp_rank, header.path) for t in tensors], dtype=np.int64)
        offsets = np.array([t.offset for t in tensors], dtype=np.int64)
        for r in np.unique(req):
            rows = np.flatnonzero(req == r)
            rid = header.requests[int(r)]
            flat = offsets[:, None, None] + np.arange(3)[None, :, None] * n + rows[None, None, :]
            block = values[flat].astype(np.float64)
            entry = side.requests.setdefault(rid, RequestRows())
            entry.files.add(header.path)
            entry.tp_size.add(header.tp_size)
            why = _check_block(block, header, tensors, pos[rows], rid)
            if why is not None:
                entry.problems.append(why)
                continue
            entry.chunks.setdefault(header.tp_rank, []).append((index, pos[rows], block))
            if kind == "token" and (header.phase == "prefill" or rows.size > 1):
                entry.prompt = max(entry.prompt, int(pos[rows].max()) + 1)


def read_side(side: str, folder: Path) -> SideRecords:
    """Every finished record of SIDE under FOLDER (`{pid}/rec{K}.json`), per request (module doc)."""
    listing = list_side(folder)
    if listing.orphans:
        raise UserError(
            f"{listing.orphans[0]}: a record header without its data file ({listing.orphans[0].stem}.f32)"
            f"{f' (and {len(listing.orphans) - 1} more)' if len(listing.orphans) > 1 else ''}; the folder was "
            "changed after the run: restore the file or remove the header."
        )
    out = SideRecords(side, folder, unfinished=len(listing.unfinished), bytes=listing.bytes)
    for path in listing.headers:
        header = read_header(path, side)
        add_record(out, header, read_values(header))
        out.records += 1
    if not out.records:
        raise UserError(
            f"{folder}: no finished record (rec*.json){f'; {out.unfinished} unfinished' if out.unfinished else ''}. "
            "Records are written with RL_MSPROBE_RECORD_DIR set on both sides (docs/records.md)."
        )
    return out


PLAN = "plan.json"  # optional, beside the records (the root): {"records_estimate_bytes": N}


def plan_estimate(folders: dict[str, Path]) -> int | None:
    """The plan's estimate of the records' bytes, when the planner left `plan.json` in the records
    root (`records_estimate_bytes`: both sides, the whole run); None when there is none."""
    roots = {p.parent for p in folders.values()}
    for root in sorted(roots):
        path = root / PLAN
        if not path.is_file():
            continue
        try:
            doc = json.loads(bounded.read_bytes(path, "plan", bounded.CONFIG))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"{path}: not JSON ({exc}); remove it or pass --estimate-bytes.") from None
        value = doc.get("records_estimate_bytes") if isinstance(doc, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{path}: `records_estimate_bytes` is {value!r}, not a positive integer.")
        return value
    return None

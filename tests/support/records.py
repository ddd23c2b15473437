"""Reading per-token records (docs/records.md) in tests: every finished record of a folder, the rows
of a tensor per request and position, and the comparison of those rows with a reference."""

from __future__ import annotations

import json
from array import array
from pathlib import Path


def read_records(folder: Path) -> list[tuple[dict, array]]:
    """Every finished record under FOLDER (header, float32 values), in the order written."""
    found = []
    for header_path in sorted(folder.rglob("rec*.json"), key=lambda p: (p.parent.name, int(p.stem[3:]))):
        header = json.loads(header_path.read_text())
        values = array("f")
        values.frombytes(header_path.with_suffix(".f32").read_bytes())
        found.append((header, values))
    return found


def rows_by_position(records, key_prefix: str, label: str) -> dict[str, dict[int, list[tuple[float, ...]]]]:
    """{base id: {position: [(max, min, norm), ...]}} of the tensors KEY_PREFIX* / LABEL, every row
    the records hold (token rows and sample rows), so that a duplicate shows as a second entry."""
    out: dict[str, dict[int, list[tuple[float, ...]]]] = {}
    for header, values in records:
        for tensor in header["tensors"]:
            if not tensor["key"].startswith(key_prefix) or tensor["label"] != label:
                continue
            if tensor["rows"] == "token":
                places = [
                    (req, first + k) for req, first, count in header["token_rows"] for k in range(count)
                ]
            else:
                places = [(req, position) for req, position in header["sample_rows"]]
            n, base = len(places), tensor["offset"]
            for i, (req, position) in enumerate(places):
                row = (values[base + i], values[base + n + i], values[base + 2 * n + i])
                out.setdefault(header["requests"][req], {}).setdefault(position, []).append(row)
    return out


def close(a: float, b: float, rel: float = 1e-4, floor: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


def assert_rows_equal(
    rows: dict[int, list[tuple[float, ...]]], expected: dict[int, list[float]], what: str
) -> None:
    """ROWS (position -> the records' rows there) hold exactly one row per position of EXPECTED
    (position -> [max, min, norm]), each equal to it (`close`)."""
    assert sorted(rows) == sorted(expected), f"{what}: positions {sorted(rows)} != {sorted(expected)}"
    for position, want in expected.items():
        (got,) = rows[position]
        assert all(close(g, e) for g, e in zip(got, want, strict=True)), (what, position, got, want)

"""`patch list` is `rl_msprobe.patches.listing.list_sets()` rendered: its JSON is the result's own
(the array docs/json.md documents), and docs/support.md's version table is the result's table."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest

from rl_msprobe.patches import ROWS, registry
from rl_msprobe.patches.listing import SetList, list_sets
from tests.support.trees import run_cli

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["name", "project", "versions", "default_release", "native_since", "optional", "description", "pieces"]
PIECE_KEYS = ["name", "path", "essential", "runs_in"]
GENERATE = 'python -c "from rl_msprobe.patches.listing import list_sets; print(list_sets().support_table())"'


def test_the_support_table_is_the_registrys() -> None:
    """docs/support.md holds the generated table, and no other set row beside it."""
    result = list_sets()
    text = (ROOT / "docs" / "support.md").read_text(encoding="utf-8")
    assert result.support_table() in text, f"regenerate docs/support.md's table: {GENERATE}"
    rows = [line for line in text.splitlines() if re.match(r"^\| `[a-z-]+` \| [a-z-]+ \| ", line)]
    assert rows == result.support_table().splitlines()[2:]
    assert [s.name for s in result.sets] == [row.name for row in ROWS]


def test_the_ranges_the_notes_name_are_the_registrys() -> None:
    """Each set's row in "The other sets" (or its own section's first line) names its range as the
    registry has it: `LOW … HIGH`, or `≥ LOW` for a set without a newest tested release."""
    lines = (ROOT / "docs" / "support.md").read_text(encoding="utf-8").splitlines()
    wrong = {}
    for s in registry.all_sets():
        ranges = (s.range_text(), f"≥ {s.min_version}") if s.max_version is None else (s.range_text(),)
        found = [line for line in lines if line.startswith((f"| `{s.name}` | ", f"`{s.name}` ("))]
        if len(found) < 2 or not all(any(r in line for r in ranges) for line in found):
            wrong[s.name] = [line[:100] for line in found]
    assert wrong == {}


def test_patch_list_json_is_the_results_own() -> None:
    code, out, err = run_cli("patch", "list", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc == list_sets().to_json()
    assert isinstance(doc, list) and all(list(entry) == KEYS for entry in doc)
    assert all(list(piece) == PIECE_KEYS for entry in doc for piece in entry["pieces"])
    assert sum(len(entry["pieces"]) for entry in doc) >= len(doc)
    section = (ROOT / "docs" / "json.md").read_text(encoding="utf-8").split("## patch list", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert all(f"`{key}`" in section for key in KEYS + PIECE_KEYS), section


def test_the_result_is_frozen_and_the_text_has_a_header_and_a_line_per_set() -> None:
    result = list_sets()
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.sets[0].name = "x"  # type: ignore[misc]
    lines = result.text_lines()
    assert lines[0].split() == ["SET", "PROJECT", "VERSIONS", "DEFAULT", "DESCRIPTION"]
    assert [line.split()[0] for line in lines[1:]] == [s.name for s in result.sets]
    one = SetList(result.sets[:1])
    assert one.support_table().splitlines()[2] == (
        f"| `{one.sets[0].name}` | {one.sets[0].project} | {one.sets[0].versions} | {one.sets[0].default_release} |"
    )


def test_a_new_row_reaches_patch_list_the_support_table_and_the_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new set is one registry row plus its module: `patch list`, docs/support.md's table and its
    release matrix (tests/support/releases.py) follow from the row and the set without another edit."""
    from tests.support.releases import supported

    probe = dataclasses.replace(
        registry.get_set("vllm-dump"), name="vllm-probe", description="a test row", min_version="0.30.0"
    )
    module = types.ModuleType("rl_msprobe.patches.probe_row")
    module.SETS = (probe,)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(
        registry, "ROWS", (*registry.ROWS, registry.SetRow("vllm-probe", "vllm", "probe_row"))
    )
    code, out, err = run_cli("patch", "list", "--json")
    assert code == 0, err
    entry = json.loads(out)[-1]
    assert (entry["name"], entry["versions"], entry["default_release"]) == (
        "vllm-probe",
        "0.30.0 … 0.34.0",
        "0.34.0",
    )
    assert "| `vllm-probe` | vllm | 0.30.0 … 0.34.0 | 0.34.0 |" in list_sets().support_table()
    assert supported("vllm-probe") == ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]

"""The properties every codemod must pass, run over its fixture folder.

`fixtures/codemods/<codemod>/X.before.py` + `X.after.py` pairs (one per upstream shape) and
`Y.invalid.py` files (drifted sources the codemod must refuse loudly); the folder is the
codemod's `fixture_folder`. tests/codemods/test_every_codemod.py runs them for every codemod.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from rl_msprobe.codemods.base import AnchorError, Codemod, Status

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "codemods"


def pairs(folder: str) -> list[tuple[Path, Path]]:
    found = [
        (p, p.with_name(p.name.replace(".before.", ".after.")))
        for p in sorted((FIXTURES / folder).glob("*.before.py"))
    ]
    assert found, f"no fixtures in {FIXTURES / folder}"
    return found


def invalid(folder: str) -> list[Path]:
    return sorted((FIXTURES / folder).glob("*.invalid.py"))


def check_pair(codemod: Codemod, before_path: Path, after_path: Path) -> None:
    before, after = before_path.read_text(), after_path.read_text()
    result = codemod.apply(before)
    assert result == after, f"{before_path.name}: output differs from {after_path.name}"
    assert codemod.apply(result) == result, "apply must be idempotent"
    assert codemod.revert(result) == before, "revert must give back the original text"
    cst.parse_module(result)
    compile(result, str(after_path), "exec")
    assert codemod.status(before).status is Status.ABSENT
    assert codemod.status(result).status is Status.APPLIED
    # a marked line removed by hand: partial
    lines = result.splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if codemod.marker in line]
    if len(marked) > 1:
        partial = "".join(line for i, line in enumerate(lines) if i != marked[-1])
        assert codemod.status(partial).status is Status.PARTIAL
    # line endings survive: CRLF in, CRLF out, and back
    crlf = before.replace("\n", "\r\n")
    crlf_out = codemod.apply(crlf)
    assert crlf_out == result.replace("\n", "\r\n")
    assert codemod.revert(crlf_out) == crlf


def check_invalid(codemod: Codemod, path: Path) -> None:
    with pytest.raises(AnchorError) as info:
        codemod.apply(path.read_text(), version="9.9.9")
    message = str(info.value)
    assert codemod.path in message and "anchor" in message and "9.9.9" in message
    assert codemod.status(path.read_text()).status is Status.CONFLICT

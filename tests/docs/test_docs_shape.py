"""The front door stays one screen and the docs stay readable and linked (cheap: reads files)."""

from __future__ import annotations

import re

import pytest

from tests.docs.markdown import (
    README,
    ROOT,
    SKILL,
    anchors,
    console_blocks,
    doc_files,
    paragraphs,
    relative_links,
)

MAX_README_LINES = 150
MAX_WORDS = 120

FILES = doc_files()
IDS = [str(p.relative_to(ROOT)) for p in FILES]


def test_readme_fits_on_one_screen():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_docs_exist_and_the_index_names_every_page():
    pages = [p for p in FILES if p not in (README, SKILL)]
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = {(ROOT / "docs" / target).resolve() for _, target in relative_links(index)}
    assert len(pages) >= 8
    assert {p.resolve() for p in pages if p.name != "index.md"} <= listed


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_no_paragraph_is_a_wall(path):
    walls = [
        f"{path.relative_to(ROOT)}:{line}: {len(text.split())} words"
        for line, text in paragraphs(path.read_text(encoding="utf-8"))
        if len(text.split()) > MAX_WORDS
    ]
    assert not walls, "split these into lists or tables:\n" + "\n".join(walls)


def _resolves(path, target: str) -> bool:
    file, _, anchor = target.partition("#")
    dest = path.parent / file
    if not dest.exists():
        return False
    return not anchor or dest.suffix != ".md" or anchor in anchors(dest.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_relative_link_resolves(path):
    """Every relative link names a file that exists, and a heading of it where it names an anchor."""
    broken = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for line, target in relative_links(path.read_text(encoding="utf-8"))
        if not _resolves(path, target)
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_output_shown_is_checked_or_dated(path):
    """A console block with output is either run by tests/docs/test_readme.py (`<!-- checked: NAME -->`)
    or a dated recording (`<!-- recorded YYYY-MM-DD with rl-msprobe V on ... -->`)."""
    for block in console_blocks(path):
        where = f"{path.relative_to(ROOT)}:{block.line}"
        if not any(step.expected for step in block.steps):
            continue
        assert block.kind in ("checked", "recorded"), f"{where}: output without a checked/recorded marker"
        if block.kind == "recorded":
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", block.name), f"{where}: a recording needs its date"
            assert "rl-msprobe" in block.name, f"{where}: a recording names the rl-msprobe version"

"""Reading README.md and docs/**/*.md the way the docs tests need: paragraphs, links, and the
```console blocks whose output the tests check against the real commands."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKILL = ROOT / "SKILL.md"
ELISION = "…"  # a line of its own: any lines; inside a line: any text
MARKER = re.compile(r"<!--\s*(checked|recorded)\b:?\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*```")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    """README.md, SKILL.md and every page under docs/."""
    return [README, SKILL, *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of every paragraph outside code blocks and tables; each list item is
    a paragraph of its own, headings and HTML comments are none."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0

    def flush() -> None:
        if current:
            out.append((start, " ".join(current)))
            current.clear()

    for number, line in prose_lines(text):
        stripped = line.strip()
        if not stripped or stripped.startswith(("|", "#", "<!--")):
            flush()
            continue
        if LIST_ITEM.match(line):
            flush()
        if not current:
            start = number
        current.append(stripped)
    flush()
    return out


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of TEXT: lower case, punctuation dropped (letters of
    any script, digits, `-` and `_` kept), spaces as `-`."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for _, line in prose_lines(text)
        if line.startswith("#")
    }


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link that is not a URL or a bare #anchor."""
    return [
        (number, target)
        for number, line in prose_lines(text)
        for target in LINK.findall(line)
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#")
    ]


@dataclass(frozen=True)
class Step:
    """One `$ command` of a console block and the output lines shown under it."""

    line: int
    command: str
    exit_code: int | None  # from a trailing `# exit N`
    expected: tuple[str, ...]


@dataclass(frozen=True)
class ConsoleBlock:
    path: Path
    line: int
    kind: str | None  # checked | recorded | None (no marker)
    name: str  # what follows the marker word: the scenario, or the recording's date and setting
    steps: tuple[Step, ...]


def _step(line: int, text: str, expected: list[str]) -> Step:
    command, _, comment = text.partition("  #")
    code = re.search(r"\bexit (\d+)\b", comment)
    return Step(line, command.strip(), int(code.group(1)) if code else None, tuple(expected))


def console_blocks(path: Path) -> list[ConsoleBlock]:
    """Every ```console block of PATH with the marker comment on the line before its fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[ConsoleBlock] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        marker = MARKER.search(lines[i - 1]) if i else None
        start, i = i + 1, i + 1
        steps: list[Step] = []
        command: tuple[int, str] | None = None
        expected: list[str] = []
        while i < len(lines) and not FENCE.match(lines[i]):
            if lines[i].startswith("$ "):
                if command:
                    steps.append(_step(*command, expected))
                command, expected = (i + 1, lines[i][2:]), []
            else:
                expected.append(lines[i].rstrip())
            i += 1
        if command:
            steps.append(_step(*command, expected))
        kind, name = (marker.group(1), marker.group(2)) if marker else (None, "")
        blocks.append(ConsoleBlock(path, start, kind, name, tuple(steps)))
        i += 1
    return blocks


def _line_pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in expected.split(ELISION)))


def missing_output(expected: tuple[str, ...], actual: list[str]) -> str | None:
    """None when ACTUAL shows EXPECTED: each run of lines between `…` lines appears there
    consecutively, the runs in order; `…` inside a line matches any text. Else what is missing."""
    chunks: list[list[str]] = [[]]
    for line in expected:
        if line.strip() == ELISION:
            chunks.append([])
        else:
            chunks[-1].append(line)
    at = 0
    for chunk in (c for c in chunks if c):
        patterns = [_line_pattern(line) for line in chunk]
        found = next(
            (
                start
                for start in range(at, len(actual) - len(chunk) + 1)
                if all(p.fullmatch(actual[start + k].rstrip()) for k, p in enumerate(patterns))
            ),
            None,
        )
        if found is None:
            return "\n".join(chunk)
        at = found + len(chunk)
    return None

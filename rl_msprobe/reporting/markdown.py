"""Markdown tables for rl-msprobe's reports."""

from __future__ import annotations


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a pipe table; `|` and newlines inside cells are escaped."""
    esc = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in esc),
    ]

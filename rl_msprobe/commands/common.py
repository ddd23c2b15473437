"""Shared pieces of the thin command layer: JSON output and error-to-exit-code mapping."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

import click

from rl_msprobe.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])  # a command function, as click decorators take and give it
P = ParamSpec("P")
R = TypeVar("R")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


def emit_json(doc: Any) -> None:
    """Write one JSON document to stdout (nothing else goes there with --json)."""
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


class Outcome(Protocol):
    """A library result a command prints: its JSON document, its terminal lines, and whether it is fine."""

    @property
    def ok(self) -> bool: ...

    def to_json(self) -> Any: ...

    def lines(self) -> list[str]: ...


def emit_outcome(outcome: Outcome, as_json: bool) -> None:
    """Print OUTCOME (one JSON document with --json, else its lines) and exit 0 when it is ok, else 1."""
    if as_json:
        emit_json(outcome.to_json())
    else:
        for line in outcome.lines():
            click.echo(line)
    sys.exit(0 if outcome.ok else 1)


def handles_user_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn a UserError into its message on stderr and exit code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper

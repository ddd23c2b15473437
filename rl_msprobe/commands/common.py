"""Shared pieces of the thin command layer: JSON output and error-to-exit-code mapping."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import click

from rl_msprobe.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])  # a command function, as click decorators take and give it
P = ParamSpec("P")
R = TypeVar("R")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


def emit_json(doc: Any) -> None:
    """Write one JSON document to stdout (nothing else goes there with --json)."""
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


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

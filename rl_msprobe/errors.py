"""Errors that end a command with exit code 2 and a plain, actionable message."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, line or key and the fix. Exit code 2."""

    exit_code = 2

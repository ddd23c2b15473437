"""`prepare`'s command-line flags as one frozen value: the library's PrepareOptions plus --json.

click hands a command its options as keyword arguments named after each option's parameter;
`PrepareFlags(**params)` takes exactly those (a flag added to `prepare_options` without a field
in PrepareOptions is a TypeError on the first run, in every CLI test).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_msprobe.planner.api import PrepareOptions, int_list

__all__ = ["PrepareFlags", "int_list"]


@dataclass(frozen=True)
class PrepareFlags(PrepareOptions):
    """Every option of `rl-msprobe prepare`, as click parsed it (the text of list options as typed)."""

    as_json: bool = False

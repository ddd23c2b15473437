"""The two test tiers: the default one (the README's test line, what CI runs) and the full one.

``python -m pytest -q`` runs the default tier: every unit and fixture test, one full patch cycle
on the newest release of each upstream, the report's browser check, one live verl job (2 ranks,
rollout TP=2, consistency and weights assertions) and one live SGLang engine. ``--full`` (or
``RL_MSPROBE_FULL=1``) adds the tests marked ``full``: every other release, the upstream-history
sweep, every other live job and engine. A ``full`` test is deselected in the default tier, never
skipped, so the CI skip gate (tests/support/skip_gate.py) is not involved. docs/testing.md says
which tier holds what.

The rule from here on: a new capability adds assertions to a job that already runs; a new live job
joins the default tier only if it replaces one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from packaging.version import Version

MARK = "full"
_state = {"full": os.environ.get("RL_MSPROBE_FULL") == "1"}


def full() -> bool:
    """Whether this session runs the full tier (module fixtures use it to choose their jobs)."""
    return _state["full"]


def examples(default: int, full_tier: int) -> int:
    """A slow property's hypothesis example count in this tier (modules are imported after
    `pytest_configure`, so the tier is known when their `settings` are built)."""
    return full_tier if full() else default


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="the full tier: every release, the history sweep, every live job (docs/testing.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--full"):
        _state["full"] = True


@pytest.hookimpl(tryfirst=True)  # before the prebuild's reordering, which must see only what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if full():
        return
    kept = [item for item in items if not item.get_closest_marker(MARK)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(MARK)])
        items[:] = kept


def newest_in_default(
    params: Iterable[Any], version: Callable[[Any], str] = str, keep: Sequence[str] = ()
) -> list:
    """PARAMS (versions, or tuples whose VERSION is one) with all but the newest version, and those
    named in KEEP, marked for the full tier only."""
    params = list(params)
    versions = sorted({version(p) for p in params}, key=Version)
    default = {versions[-1], *keep} if versions else set(keep)
    return [
        p
        if version(p) in default
        else pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.full)
        for p in params
    ]

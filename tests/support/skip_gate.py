"""CI fails when a test was skipped for any reason but a missing accelerator.

A skip in CI almost always means an install step is missing (a browser, an extra, a test venv
that could not be built), and a green run would hide it. So under CI (`CI` or
`RL_MSPROBE_STRICT_SKIPS=1`, both set by `.ci/run`) the session fails, listing each skip, unless
its reason starts with HARDWARE_SKIP: the one documented, hardware-bound reason (an NPU / GPU
test on a CPU machine). Use `skip_without_accelerator()` for those. Opt-outs by environment
variable (RL_MSPROBE_SKIP_JOB_E2E, ...) are never set in CI, so their skips fail it too.
Outside CI nothing changes: skips stay skips, reported by `-ra`.
"""

from __future__ import annotations

import os

import pytest

HARDWARE_SKIP = "no accelerator:"  # docs/testing.md, "Skips"
_SKIPS: list[tuple[str, str]] = []


def skip_without_accelerator(what: str) -> None:
    """Skip a test that needs an NPU / GPU this machine does not have (the only skip CI accepts)."""
    pytest.skip(f"{HARDWARE_SKIP} {what}")


def strict() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("RL_MSPROBE_STRICT_SKIPS") == "1")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _reason(report)))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _SKIPS.append((report.nodeid, _reason(report)))


def disallowed() -> list[tuple[str, str]]:
    return [(node, why) for node, why in _SKIPS if not why.startswith(HARDWARE_SKIP)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if strict() and disallowed() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    bad = disallowed()
    if not (strict() and bad):
        return
    terminalreporter.section("skips CI does not accept", sep="=", red=True, bold=True)
    for node, why in bad:
        terminalreporter.line(f"SKIPPED {node}: {why}", red=True)
    terminalreporter.line(
        f"Only skips whose reason starts with {HARDWARE_SKIP!r} pass in CI (CI or RL_MSPROBE_STRICT_SKIPS=1 "
        "is set): install what the test needs, or fix the test."
    )

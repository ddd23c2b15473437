"""matplotlib for a report's pictures, when it can be had: a report is written either way."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> tuple[ModuleType | None, str | None]:
    """(matplotlib.pyplot on the Agg backend, None), or (None, why there will be no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # not installed, or a broken install
        return (
            None,
            f"matplotlib is not installed or broken ({exc}): no plot; pip install matplotlib (the tables carry the numbers)",
        )
    return plt, None

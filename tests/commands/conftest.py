"""The fixtures the command tests share with the library tests they drive (no copies)."""

from __future__ import annotations

from tests.dumps.conftest import consistency_tree  # noqa: F401  (the hand-made dumps and logs of `dumps correlate`)

"""The fixtures the command tests share with the library tests they drive (no copies)."""

from __future__ import annotations

from tests.dumps.conftest import consistency_tree  # noqa: F401  (the hand-made dumps and logs of `dumps correlate`)
from tests.planner.conftest import no_hub_cache  # noqa: F401  (autouse: an empty Hugging Face cache)

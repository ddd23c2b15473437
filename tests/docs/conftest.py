"""The docs tests run prepare on the fixture jobs: with an empty Hugging Face cache, as everywhere."""

from tests.planner.conftest import no_hub_cache  # noqa: F401  (autouse: an empty Hugging Face cache)

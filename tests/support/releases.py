"""The upstream releases the release tests fetch, and each patch set's matrix derived from them.

A set's matrix is the releases of its project inside the set's range (the registry's `min_version`
… `max_version`), up to its default release (the project's newest tested one in
`upstream/projects.py`, or for SGLang's native-debugger sets the newest native one). So a new
release is one entry below (and, when it is the newest, one field of the projects table), and a new
set's matrix is read from its registry row. Which of them run in the default tier stays
`tests.support.tiers.newest_in_default`.
"""

from __future__ import annotations

from packaging.version import Version

from rl_msprobe.codemods.base import version_in_range
from rl_msprobe.patches import get_set
from rl_msprobe.patches.default_release import default_release

# project -> its releases the tests fetch, oldest first. verl: every release with engine files;
# SGLang: every release on the index from 0.4.6.post5 below 0.5.11 (none was yanked or skipped),
# and the native-debugger releases cycled; vLLM: every release in vllm-dump's range; vLLM-Ascend:
# the last without msprobe support, then one per code shape.
RELEASES: dict[str, tuple[str, ...]] = {
    "verl": ("0.6.0", "0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1"),
    "sglang": (
        *("0.4.6.post5", "0.4.7", "0.4.7.post1", "0.4.8", "0.4.8.post1"),
        *(f"0.4.9{p}" for p in ("", ".post1", ".post2", ".post3", ".post4", ".post5", ".post6")),
        *("0.4.10", "0.4.10.post1", "0.4.10.post2"),
        *("0.5.1", "0.5.1.post1", "0.5.1.post2", "0.5.1.post3", "0.5.2"),
        *("0.5.3", "0.5.3.post1", "0.5.3.post2", "0.5.3.post3"),
        *("0.5.4", "0.5.4.post1", "0.5.4.post2", "0.5.4.post3"),
        *("0.5.5", "0.5.5.post1", "0.5.5.post2", "0.5.5.post3"),
        *("0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1"),
        *("0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12"),
    ),
    "vllm": (
        *("0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0"),
        *("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    ),
    "vllm-ascend": ("0.11.0", "0.12.0rc1", "0.13.0", "0.18.0", "0.23.0.post1", "0.28.0rc1", "0.30.0rc2"),
}


def supported(set_name: str) -> list[str]:
    """The releases set SET_NAME is tested on, oldest first: its range, up to its default release."""
    patch_set = get_set(set_name)
    newest = Version(default_release(patch_set))
    return [
        v
        for v in RELEASES[patch_set.project]
        if version_in_range(v, patch_set.min_version, patch_set.max_version) and Version(v) <= newest
    ]


def older(set_name: str) -> list[str]:
    """The releases below set SET_NAME's range (where it is refused), oldest first."""
    patch_set = get_set(set_name)
    oldest = Version(patch_set.min_version or "0")
    return [v for v in RELEASES[patch_set.project] if Version(v) < oldest]

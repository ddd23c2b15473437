"""The release each patch set uses when no tree is given: the newest one its tests run on.

Read from the upstream table (`upstream.projects`) by `patch list` (shown), `patch diff` /
`patch status` without --tree (used) and by the release tests (which run the full patch cycle on
it), so the default a user sees is always a release the suite has patched, reverted and compiled.
"""

from __future__ import annotations

from rl_msprobe.codemods.base import version_in_range
from rl_msprobe.patches.patch_set import PatchSet
from rl_msprobe.upstream import projects


def newest_tested() -> dict[str, str]:
    """project -> the newest release the project's sets are tested on (tests/**/test_*release*.py)."""
    return {p.name: p.newest_tested for p in projects.PROJECTS}


def default_release(patch_set: PatchSet) -> str:
    """The release `patch diff SET` reads when neither --tree nor --python is given: the project's
    newest tested release, or for a set that starts above it (SGLang's native-debugger sets) the
    newest release those sets are tested on."""
    row = projects.project(patch_set.project)
    if (
        version_in_range(row.newest_tested, patch_set.min_version, patch_set.max_version)
        or row.native_tested is None
    ):
        return row.newest_tested
    return row.native_tested

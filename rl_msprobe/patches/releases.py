"""The release each patch set uses when no tree is given: the newest one its tests run on.

One table, read by `patch list` (shown), `patch diff` / `patch status` without --tree (used)
and by the release tests (which run the full patch cycle on it), so the default a user sees
is always a release the suite has patched, reverted and compiled.
"""

from __future__ import annotations

from rl_msprobe.patches import PatchSet


def newest_tested() -> dict[str, str]:
    """project -> the newest release the project's sets are tested on (tests/**/test_*release*.py)."""
    from rl_msprobe.patches import sglang, verl, vllm, vllm_ascend

    return {
        "verl": verl.NEWEST,
        # sglang-bootstrap-room has no upper bound; its full cycle, like sglang-dump's, stops here
        "sglang": sglang.NEWEST,
        "vllm": vllm.NEWEST,
        "vllm-ascend": vllm_ascend.NEWEST_TESTED,
    }


def default_release(patch_set: PatchSet) -> str:
    """The release `patch diff SET` reads when neither --tree nor --python is given."""
    return newest_tested()[patch_set.project]

"""A fixed bootstrap room for PD + DP dumps. Added to this tree by rl-msprobe (patch set sglang-bootstrap-room).

`sglang/srt/managers/io_struct.py` calls `pin(self)` from one marked line
(`# rl-msprobe:sglang-io-struct`) at the top of `GenerateReqInput._normalize_bootstrap_params`;
`rl-msprobe patch revert sglang-bootstrap-room --tree <this tree>` removes it and this file.

With PD disaggregation and data parallelism, SGLang's DP controller sends a request to the
DP rank `bootstrap_room % dp_size`; rooms are random unless the caller gives one, so the
same prompt lands on another rank (and another `rank{R}` dump folder) on every run.

  MSPROBE_BOOTSTRAP_ROOM=N   a batch that comes without a bootstrap room gets room N; SGLang's
                             own normalisation then gives its requests N, N+1, … — the same DP
                             ranks on every run. Rooms the caller set are left alone.
Unset or empty: nothing changes. Depends on nothing but the standard library.
"""

from __future__ import annotations

import os

ENV_ROOM = "MSPROBE_BOOTSTRAP_ROOM"


def pinned_room() -> int | None:
    value = os.environ.get(ENV_ROOM, "").strip()
    if not value:
        return None
    try:
        room = int(value)
    except ValueError:
        raise ValueError(f"{ENV_ROOM}={value!r}: must be a non-negative integer (or unset).") from None
    if room < 0:
        raise ValueError(f"{ENV_ROOM}={value!r}: must be a non-negative integer (or unset).")
    return room


def pin(request) -> None:
    """First line of GenerateReqInput._normalize_bootstrap_params."""
    room = pinned_room()
    if room is not None and getattr(request, "bootstrap_room", None) is None:
        request.bootstrap_room = room

"""One msprobe dump folder per PD disaggregation role for SGLang's own debugger. Added to this tree
by rl-msprobe (patch set sglang-pd-dump-path).

`sglang/srt/model_executor/model_runner.py` calls `role_dump_path(self)` right after it creates
its msprobe debugger from the server argument msprobe_dump_config (marked
`# rl-msprobe:sglang-pd-dump-path`); `rl-msprobe patch revert sglang-pd-dump-path --tree <this
tree>` removes that line and this file.

Why: a PD rollout's prefill and decode servers are started with the same server arguments (verl
passes one `engine_kwargs.sglang` to both), so both read one config, and each is rank 0 of its own
server: both would write `{dump_path}/step{N}/rank0`. Here the prefill server's dumps go to
`{dump_path}/prefill/...` and the decode server's to `{dump_path}/decode/...` (the layout of the
sglang-dump patch with MSPROBE_PREFILL_CONFIG / MSPROBE_DECODE_CONFIG below 0.5.11). Without PD
(`disaggregation_mode` null) nothing changes.

It depends on nothing but the standard library and SGLang's objects (duck-typed).
"""

from __future__ import annotations

import os

ROLES = ("prefill", "decode")


def role(server_args) -> str | None:
    mode = getattr(server_args, "disaggregation_mode", None)
    mode = str(getattr(mode, "value", mode) or "null").lower()  # an enum in some versions
    return mode if mode in ROLES else None


def role_dump_path(runner) -> None:
    """After `self.msprobe_debugger = ...` in ModelRunner: dump_path/<role> with PD."""
    debugger = getattr(runner, "msprobe_debugger", None)
    config = getattr(getattr(debugger, "service", None), "config", None)
    which = role(getattr(runner, "server_args", None))
    if config is None or which is None or not getattr(config, "dump_path", None):
        return
    if os.path.basename(os.path.normpath(config.dump_path)) != which:  # not twice
        config.dump_path = os.path.join(config.dump_path, which)

"""msprobe rollout dump for SGLang's ModelRunner. Added to this tree by rl-msprobe (patch set sglang-dump).

`sglang/srt/model_executor/model_runner.py` calls this module from a few marked lines
(`# rl-msprobe:sglang-model-runner`); `rl-msprobe patch revert sglang-dump --tree <this tree>`
removes them and this file. SGLang 0.5.11 and later dump natively
(`--msprobe-dump-config`; verl: `++actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config=`).

Environment (which config a ModelRunner uses):
  MSPROBE_PREFILL_CONFIG=PATH   PD disaggregation, prefill servers (disaggregation_mode "prefill")
  MSPROBE_DECODE_CONFIG=PATH    PD disaggregation, decode servers (disaggregation_mode "decode")
  MSPROBE_ROLLOUT_CONFIG=PATH   everything else, and the PD servers whose own variable is unset
Unset or empty: every function here returns at once, msprobe is never imported and SGLang
behaves exactly as before. The config must set dump_path (msprobe writes
`{dump_path}/step{N}/rank{R}/dump.json`). Draft-model runners (speculative decoding) are not
dumped: msprobe's debugger is one per process and belongs to the target model.

What it does while a config is set (what SGLang 0.5.11 does natively):
  - `create(runner)` in `ModelRunner.__init__`: one `PrecisionDebugger(config_path=...)`;
    CUDA graphs are turned off for this process (`server_args.disable_cuda_graph = True`):
    msprobe cannot see the layers of a replayed graph.
  - `start(runner)` after the forward-pass counter in `forward`: `debugger.start(model=runner.model)`,
    with `rank_id=runner.gpu_id` when data parallel size > 1 (DP replicas share TP ranks).
  - `finish(runner)` before `return output`: `debugger.stop()` then `debugger.step()`: one
    `step{N}` per forward pass.

It depends on nothing but the standard library and, lazily, msprobe.
"""

from __future__ import annotations

import logging
import os

ENV_ROLLOUT = "MSPROBE_ROLLOUT_CONFIG"
ENV_PREFILL = "MSPROBE_PREFILL_CONFIG"
ENV_DECODE = "MSPROBE_DECODE_CONFIG"
ATTR = "_rl_msprobe_debugger"

logger = logging.getLogger(__name__)


class RlMsprobeDumpError(RuntimeError):
    """A config is set but the dump cannot run: one clear message."""


def _mode(server_args) -> str:
    mode = getattr(server_args, "disaggregation_mode", None)
    mode = getattr(mode, "value", mode)  # an enum in some versions
    return str(mode or "null").lower()


def config_path(server_args) -> str | None:
    """The msprobe config this runner uses, by PD role (see the module doc), or None."""
    mode = _mode(server_args)
    if mode == "prefill" and os.environ.get(ENV_PREFILL):
        return os.environ[ENV_PREFILL]
    if mode == "decode" and os.environ.get(ENV_DECODE):
        return os.environ[ENV_DECODE]
    return os.environ.get(ENV_ROLLOUT) or None


def rank_id(runner) -> int | None:
    """`gpu_id` when data parallel size > 1 (else msprobe takes the torch.distributed rank)."""
    server_args = getattr(runner, "server_args", None)
    dp_size = getattr(server_args, "dp_size", None) or getattr(runner, "dp_size", None) or 1
    return getattr(runner, "gpu_id", None) if dp_size > 1 else None


def create(runner):
    """In ModelRunner.__init__: the debugger for this runner, or None when no config is set."""
    server_args = getattr(runner, "server_args", None)
    path = config_path(server_args)
    if path is None or getattr(runner, "is_draft_worker", False):
        setattr(runner, ATTR, None)
        return None
    if not os.path.isfile(path):
        raise RlMsprobeDumpError(f"msprobe config {path} (from {ENV_ROLLOUT} / PD variables) does not exist.")
    try:
        from msprobe.pytorch import PrecisionDebugger
    except ImportError as exc:
        raise RlMsprobeDumpError(
            f"an msprobe config is set ({path}) but msprobe is not importable here ({exc}): "
            "pip install mindstudio-probe in SGLang's Python, or unset the variable."
        ) from None
    if server_args is not None and not getattr(server_args, "disable_cuda_graph", True):
        logger.warning("rl-msprobe: msprobe dump on: CUDA graphs turned off in this process (eager forward).")
        server_args.disable_cuda_graph = True
    debugger = PrecisionDebugger(config_path=path)
    setattr(runner, ATTR, debugger)
    return debugger


def start(runner) -> None:
    """After `self.forward_pass_id += 1` in ModelRunner.forward."""
    debugger = getattr(runner, ATTR, None)
    if debugger is not None:
        debugger.start(model=runner.model, rank_id=rank_id(runner))


def finish(runner) -> None:
    """Before `return output` in ModelRunner.forward: this forward pass is one msprobe step."""
    debugger = getattr(runner, ATTR, None)
    if debugger is not None:
        debugger.stop()
        debugger.step()

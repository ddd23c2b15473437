"""Patch sets for verl."""

from __future__ import annotations

from rl_msprobe.codemods.verl_fsdp_engine import VerlFSDPEngine
from rl_msprobe.codemods.verl_megatron_engine import VerlMegatronEngine
from rl_msprobe.patches import NewFile, PatchSet, Piece, register

NEWEST = "0.9.1"  # newest verl release every verl set is tested on; the default release for `patch diff`

HOOKS_FILE = NewFile("verl", "verl/utils/rl_msprobe_hooks.py", name="verl-hooks-file")

VERL_ENGINE = register(
    PatchSet(
        name="verl-engine",
        project="verl",
        description="msprobe dump per micro-batch in the FSDP and Megatron training engines (DUMP_ON=1)",
        pieces=(Piece(HOOKS_FILE), Piece(VerlFSDPEngine()), Piece(VerlMegatronEngine())),
        min_version="0.6.0",
        max_version=NEWEST,
        notes=(
            "verl <= 0.7.1 runs the legacy workers by default: add trainer.use_legacy_worker_impl=disable "
            "so the patched engine runs (rl-msprobe prepare does).",
        ),
    )
)

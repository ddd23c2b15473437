"""The verl-engine patch set: msprobe dumps and per-token records in the FSDP and Megatron training engines."""

from __future__ import annotations

from rl_msprobe.codemods.verl_fsdp_engine import VerlFSDPEngine
from rl_msprobe.codemods.verl_megatron_engine import VerlMegatronEngine
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece
from rl_msprobe.upstream.projects import project

NEWEST = project("verl").newest_tested  # every verl set is tested up to it

FSDP_HOOK = Capability(
    "FSDP engine hook",
    "FSDPEngine.forward_backward_batch in verl/workers/engine/fsdp/transformer_impl.py",
    ("verl-fsdp-engine",),
)
MEGATRON_HOOK = Capability(
    "Megatron engine hook",
    "MegatronEngineWithLMHead.forward_step in verl/workers/engine/megatron/transformer_impl.py",
    ("verl-megatron-engine",),
)

HOOKS_FILE = NewFile("verl", "verl/utils/rl_msprobe_hooks.py", name="verl-hooks-file")
# the shared per-token recorder (docs/records.md), one source for every tree that records
RECORDS_FILE = NewFile(
    "verl",
    "verl/utils/rl_msprobe_records.py",
    name="verl-records-file",
    source="common/rl_msprobe_records.py",
)

VERL_ENGINE = PatchSet(
    name="verl-engine",
    project="verl",
    description="msprobe dump per micro-batch in the FSDP and Megatron training engines (DUMP_ON=1), and "
    "per-token records of the actor's log-prob forward (RL_MSPROBE_RECORD_DIR)",
    pieces=(Piece(HOOKS_FILE), Piece(RECORDS_FILE), Piece(VerlFSDPEngine()), Piece(VerlMegatronEngine())),
    capabilities=(FSDP_HOOK, MEGATRON_HOOK),
    min_version="0.6.0",
    max_version=NEWEST,
    version_notes=(
        (
            None,
            "0.7.1",
            "verl <= 0.7.1 runs the legacy workers by default: add trainer.use_legacy_worker_impl=disable "
            "so the patched engine runs (rl-msprobe prepare does).",
        ),
    ),
)

SETS = (VERL_ENGINE,)

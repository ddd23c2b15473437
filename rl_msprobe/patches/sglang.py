"""Patch sets for SGLang: the ModelRunner dump below 0.5.11, the dispatch log that pairs a dumped
prefill with its request (consistency), and the optional fixed bootstrap room."""

from __future__ import annotations

import ast

from rl_msprobe.codemods.base import top_level_classes
from rl_msprobe.codemods.sglang_dispatch_log import SGLangDispatchLog
from rl_msprobe.codemods.sglang_io_struct import SGLangIoStruct
from rl_msprobe.codemods.sglang_model_runner import SGLangModelRunner
from rl_msprobe.codemods.sglang_pd_dump_path import SGLangPdDumpPath
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece, Probe
from rl_msprobe.upstream.projects import project

OLDEST = "0.4.6.post5"
NEWEST = project("sglang").newest_tested  # the last release without native msprobe support
NATIVE_SINCE = "0.5.11"


def _runner_has_own_debugger(source: str) -> bool:
    """Does class ModelRunner set `self.msprobe_debugger` anywhere in its body?"""
    runner = top_level_classes(source).get("ModelRunner")
    return runner is not None and any(
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == "msprobe_debugger"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(runner)
    )


# SGLang's own msprobe support (0.5.11 and later): ModelRunner creates a debugger from the server
# argument msprobe_dump_config. Probed in ModelRunner, where the dump happens: the argument's
# declaration moved out of ServerArgs' body (arg_groups/fields/ in 0.5.23).
NATIVE = Probe(
    "sglang/srt/model_executor/model_runner.py",
    "ModelRunner's own msprobe debugger (self.msprobe_debugger, from the server argument msprobe_dump_config)",
    _runner_has_own_debugger,
)
NATIVE_OVERRIDE = "++actor_rollout_ref.rollout.engine_kwargs.sglang.msprobe_dump_config=/abs/path/config.json"

DUMP_FILE = NewFile("sglang", "sglang/srt/model_executor/rl_msprobe_dump.py", name="sglang-dump-file")
DISPATCH_FILE = NewFile(
    "sglang", "sglang/srt/model_executor/rl_msprobe_dispatch.py", name="sglang-dispatch-log-file"
)
RECORDS_FILE = NewFile(
    "sglang",
    "sglang/srt/model_executor/rl_msprobe_records.py",
    name="sglang-records-file",
    source="common/rl_msprobe_records.py",
)
PD_FILE = NewFile("sglang", "sglang/srt/model_executor/rl_msprobe_pd.py", name="sglang-pd-dump-path-file")
ROOM_FILE = NewFile(
    "sglang", "sglang/srt/managers/rl_msprobe_bootstrap_room.py", name="sglang-bootstrap-room-file"
)

SGLANG_DUMP = PatchSet(
    name="sglang-dump",
    project="sglang",
    description="msprobe debugger in ModelRunner (MSPROBE_ROLLOUT_CONFIG; PD: MSPROBE_PREFILL/DECODE_CONFIG)",
    pieces=(Piece(DUMP_FILE), Piece(SGLangModelRunner())),
    capabilities=(
        Capability(
            "create / start / stop sites",
            "ModelRunner.__init__ (create) and ModelRunner.forward (start, stop + step) in "
            "sglang/srt/model_executor/model_runner.py",
            ("sglang-model-runner",),
        ),
    ),
    min_version=OLDEST,
    max_version=NEWEST,
    native=NATIVE,
    native_since=NATIVE_SINCE,
    native_hint=(
        f"SGLang >= {NATIVE_SINCE} dumps with msprobe itself (server argument msprobe_dump_config): "
        f"pass {NATIVE_OVERRIDE} to verl instead of patching."
    ),
    notes=(
        "Set MSPROBE_ROLLOUT_CONFIG (PD disaggregation: MSPROBE_PREFILL_CONFIG / MSPROBE_DECODE_CONFIG) in the "
        "rollout's environment; the config must set dump_path. CUDA graphs are turned off while it is set.",
    ),
)

SGLANG_BOOTSTRAP_ROOM = PatchSet(
    name="sglang-bootstrap-room",
    project="sglang",
    description="optional: MSPROBE_BOOTSTRAP_ROOM pins the bootstrap room, so PD + DP routing repeats",
    pieces=(Piece(ROOM_FILE), Piece(SGLangIoStruct())),
    capabilities=(
        Capability(
            "bootstrap room pin",
            "GenerateReqInput._normalize_bootstrap_params in sglang/srt/managers/io_struct.py (SGLang 0.5.2+)",
            ("sglang-io-struct",),
        ),
    ),
    min_version="0.5.2",
    optional=True,
    notes=(
        "Only useful with PD disaggregation and data parallel size > 1.",
        "Pins batched requests only: SGLang runs GenerateReqInput._normalize_bootstrap_params for batches; a "
        "single request keeps the room its router gives it (without one a PD server rejects it).",
    ),
)

SGLANG_DISPATCH_LOG = PatchSet(
    name="sglang-dispatch-log",
    project="sglang",
    description="dispatch_log.jsonl: the request ids of each dumped forward pass (pairs rollout and actor dumps)",
    pieces=(Piece(DISPATCH_FILE), Piece(RECORDS_FILE), Piece(SGLangDispatchLog())),
    capabilities=(
        Capability(
            "dispatch log",
            "the first line of ModelRunner.forward(self, forward_batch) in sglang/srt/model_executor/model_runner.py",
            ("sglang-dispatch-log",),
        ),
    ),
    min_version="0.5.10",
    notes=(
        "Logs while an msprobe debugger dumps in the ModelRunner (SGLang's own msprobe_dump_config, or the "
        "sglang-dump patch's): {dump_path}/{pid}/dispatch_log.jsonl, read by `rl-msprobe dumps correlate`.",
        "Needs ForwardBatch.rids (SGLang 0.5.10 and later): on an older tree the first dumped forward pass "
        "stops the rollout with an error saying so.",
        "The same line writes per-token records (docs/records.md) of the selected requests when "
        "RL_MSPROBE_RECORD_DIR is set, with or without an msprobe dump (eager: --disable-cuda-graph).",
    ),
)

SGLANG_PD_DUMP_PATH = PatchSet(
    name="sglang-pd-dump-path",
    project="sglang",
    description="PD disaggregation with SGLang's own msprobe: dumps under <dump_path>/prefill and <dump_path>/decode",
    pieces=(Piece(PD_FILE), Piece(SGLangPdDumpPath())),
    capabilities=(
        Capability(
            "dump folder per PD role",
            "the statement creating SGLang's own debugger (self.msprobe_debugger = ...) in ModelRunner, "
            "sglang/srt/model_executor/model_runner.py (SGLang 0.5.11 and later)",
            ("sglang-pd-dump-path",),
        ),
    ),
    min_version=NATIVE_SINCE,
    notes=(
        "verl passes one engine_kwargs.sglang to the prefill and the decode servers: without this both write "
        "step{N}/rank0 under one dump_path. Below 0.5.11 use sglang-dump with MSPROBE_PREFILL_CONFIG / "
        "MSPROBE_DECODE_CONFIG instead.",
    ),
)

SETS = (SGLANG_DUMP, SGLANG_DISPATCH_LOG, SGLANG_PD_DUMP_PATH, SGLANG_BOOTSTRAP_ROOM)

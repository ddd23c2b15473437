"""Patch sets for upstream (GPU) vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rl_msprobe import bounded
from rl_msprobe.codemods.vllm_model_runner import VllmModelRunner
from rl_msprobe.codemods.vllm_model_runner_v2 import VllmModelRunnerV2
from rl_msprobe.errors import UserError
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece, where_present
from rl_msprobe.upstream.projects import project

OLDEST = "0.24.0"
NEWEST = project("vllm").newest_tested

ENV_CONFIG = "MSPROBE_ROLLOUT_CONFIG"

DUMP_FILE = NewFile("vllm", "vllm/v1/worker/rl_msprobe_dump.py", name="vllm-dump-file")
# the shared per-token recorder (docs/records.md), one source for every tree that records
RECORDS_FILE = NewFile(
    "vllm",
    "vllm/v1/worker/rl_msprobe_records.py",
    name="vllm-records-file",
    source="common/rl_msprobe_records.py",
)
V1_RUNNER = VllmModelRunner()
V2_RUNNER = VllmModelRunnerV2()
RUNNERS = (V1_RUNNER, V2_RUNNER)  # every model runner the dump path is wired into, where the tree has it

VLLM_DUMP = PatchSet(
    name="vllm-dump",
    project="vllm",
    description=(
        f"msprobe dump of every rollout model step in vLLM's model runners (V1 and V2, whichever the tree "
        f"has), plus the dispatch log ({ENV_CONFIG}=config.json; needs enforce_eager=True)"
    ),
    pieces=(
        Piece(DUMP_FILE),
        Piece(RECORDS_FILE),
        # where_present: the tree's code decides (V1 only, both, V2 only from vLLM 0.34.0)
        where_present(V1_RUNNER, "no V1 model runner in this vLLM (removed in 0.34.0): the V2 runner dumps"),
        where_present(V2_RUNNER, "no V2 model runner in this vLLM: the V1 runner dumps"),
    ),
    capabilities=(
        Capability(
            "model-step dump",
            "GPUModelRunner.__init__, execute_model and its model forward in vllm/v1/worker/gpu_model_runner.py "
            "(V1) or vllm/v1/worker/gpu/model_runner.py (V2)",
            (V1_RUNNER.name, V2_RUNNER.name),
        ),
    ),
    min_version=OLDEST,
    max_version=NEWEST,
    notes=(
        "both model runners are patched where the tree has both (VLLM_USE_V2_MODEL_RUNNER, or vLLM itself, "
        "chooses one at start-up; either dumps), so no runner setting is needed; vLLM 0.34.0 has only the V2 "
        "runner and refuses VLLM_USE_V2_MODEL_RUNNER=0.",
        f"the dump is enabled by {ENV_CONFIG}=<msprobe config.json with dump_path>; unset, the patched "
        "runner behaves as before and never imports msprobe.",
        "per-token records (docs/records.md) of the selected requests are written when RL_MSPROBE_RECORD_DIR is "
        f"set, with or without {ENV_CONFIG}; both unset, the runner imports nothing of rl-msprobe's.",
        "eager execution is required (actor_rollout_ref.rollout.enforce_eager=True); the runner refuses "
        "to start otherwise.",
        "a V1 step covers the model forward and the logits; a V2 step the model forward (the V2 runner "
        "computes the logits later, in sample_tokens).",
        "output: {dump_path}/{pid}/step{N}/rank{R}/dump.json per model step and "
        "{dump_path}/{pid}/dispatch_log.jsonl (one line per dumped step).",
    ),
)

SETS = (VLLM_DUMP,)


@dataclass(frozen=True)
class RunnerShape:
    """Which model runners of a vLLM tree the dump path can be wired into, read from its code.

    `dumped`: the runner files vllm-dump patches (applies cleanly, or is applied); `skipped`:
    "path: why not" for the others; `has_v1`: the V1 runner is in the tree (vLLM then accepts
    VLLM_USE_V2_MODEL_RUNNER=0; 0.34.0 has no V1 runner and refuses it)."""

    dumped: tuple[str, ...]
    skipped: tuple[str, ...]
    has_v1: bool


def runner_shape(root: Path, version: str | None = None) -> RunnerShape:
    """The vllm-dump runner pieces against the tree at ROOT (the folder holding `vllm/`): the same
    codemods `patch apply` runs, so a runner counts only where its anchors are found."""
    dumped: list[str] = []
    skipped: list[str] = []
    has_v1 = False
    for codemod in RUNNERS:
        path = root / codemod.path
        if not path.is_file():
            skipped.append(f"{codemod.path} is not in this tree")
            continue
        try:
            source = bounded.read_text(path, "vLLM source file", bounded.SOURCE)
        except UserError as exc:
            skipped.append(f"{codemod.path}: unreadable ({exc})")
            continue
        if not codemod.present(source):
            skipped.append(f"{codemod.path} has no {codemod.subject_text()}")
            continue
        has_v1 = has_v1 or codemod is V1_RUNNER
        try:
            codemod.apply(source, version)
        except UserError as exc:
            skipped.append(f"{codemod.path}: {exc}")
            continue
        dumped.append(codemod.path)
    return RunnerShape(tuple(dumped), tuple(skipped), has_v1)

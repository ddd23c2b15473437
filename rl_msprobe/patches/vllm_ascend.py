"""Patch set for vLLM-Ascend: the dispatch log beside its own msprobe dump."""

from __future__ import annotations

from rl_msprobe.codemods.vllm_ascend_model_runner import VllmAscendModelRunner
from rl_msprobe.patches.patch_set import Capability, NewFile, PatchSet, Piece
from rl_msprobe.upstream.projects import project

OLDEST = "0.12.0rc1"  # first release with msprobe support (additional_config.dump_config)
NEWEST_TESTED = project("vllm-ascend").newest_tested  # newer releases: the anchors decide

DISPATCH_LOGGER_FILE = NewFile(
    "vllm_ascend", "vllm_ascend/worker/dispatch_logger.py", name="vllm-ascend-dispatch-logger-file"
)
# the shared per-token recorder (docs/records.md), one source for every tree that records
RECORDS_FILE = NewFile(
    "vllm_ascend",
    "vllm_ascend/worker/rl_msprobe_records.py",
    name="vllm-ascend-records-file",
    source="common/rl_msprobe_records.py",
)

VLLM_ASCEND_DISPATCH_LOG = PatchSet(
    name="vllm-ascend-dispatch-log",
    project="vllm-ascend",
    description="dispatch_log.jsonl (which requests each dumped step served) and dumps under {pid}",
    pieces=(Piece(DISPATCH_LOGGER_FILE), Piece(RECORDS_FILE), Piece(VllmAscendModelRunner())),
    capabilities=(
        Capability(
            "dispatch log sites",
            "NPUModelRunner.__init__ (attach), every dump finish point of execute_model and sample_tokens, and "
            "the records' start (before the model forward) and step (execute_model) in "
            "vllm_ascend/worker/model_runner_v1.py",
            ("vllm-ascend-model-runner",),
        ),
    ),
    min_version=OLDEST,
    max_version=NEWEST_TESTED,
    notes=(
        "The dump itself is vLLM-Ascend's own (additional_config.dump_config_path, eager execution); "
        "this set only adds the dispatch log and the {pid} sub-folder.",
        "Per-token records (docs/records.md) of the selected requests when RL_MSPROBE_RECORD_DIR is set, with or "
        "without that dump (eager execution); proven by shape on the release trees, not run on an NPU here.",
        "Only the V1 runner (vllm_ascend/worker/model_runner_v1.py) dumps: vLLM-Ascend's V2 runner "
        "(worker/v2/model_runner.py, chosen when vLLM's use_v2_model_runner is on) has no msprobe support up to "
        f"{NEWEST_TESTED}, so keep VLLM_USE_V2_MODEL_RUNNER=0 in the rollout's environment. That V2 runner "
        "(0.13.0 on) runs vLLM's own V2 GPUModelRunner.execute_model (inherited, or through super() from 0.28), "
        "which vllm-dump patches in the vLLM tree; that route is not tested on NPU.",
        f"Tested on vLLM-Ascend {OLDEST} … {NEWEST_TESTED}.",
    ),
)

SETS = (VLLM_ASCEND_DISPATCH_LOG,)

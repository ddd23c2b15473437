"""Patch sets for upstream (GPU) vLLM."""

from __future__ import annotations

from rl_msprobe.codemods.vllm_model_runner import VllmModelRunner
from rl_msprobe.codemods.vllm_model_runner_v2 import VllmModelRunnerV2
from rl_msprobe.patches.model import Capability, NewFile, PatchSet, Piece
from rl_msprobe.upstream.projects import project

OLDEST = "0.24.0"
NEWEST = project("vllm").newest_tested

ENV_CONFIG = "MSPROBE_ROLLOUT_CONFIG"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER=0"

DUMP_FILE = NewFile("vllm", "vllm/v1/worker/rl_msprobe_dump.py", name="vllm-dump-file")

VLLM_DUMP = PatchSet(
    name="vllm-dump",
    project="vllm",
    description=(
        f"msprobe dump of every rollout model step in vLLM's V1 model runner, plus the dispatch log "
        f"({ENV_CONFIG}=config.json; needs {V2_ENV} and enforce_eager=True)"
    ),
    pieces=(
        Piece(DUMP_FILE),
        Piece(VllmModelRunner()),
        Piece(
            VllmModelRunnerV2(),
            essential=False,
            why_optional="this vLLM has no V2 model runner file, so only the patched V1 runner can run",
        ),
    ),
    capabilities=(
        Capability(
            "model-step dump",
            "GPUModelRunner.__init__, execute_model and its model forward in vllm/v1/worker/gpu_model_runner.py",
            ("vllm-model-runner",),
        ),
    ),
    min_version=OLDEST,
    max_version=NEWEST,
    notes=(
        f"run vLLM with {V2_ENV}: only the V1 model runner (vllm/v1/worker/gpu_model_runner.py) is "
        "patched; with the dump enabled the V2 runner refuses to start instead of running without dumps. "
        "rl-msprobe prepare writes the variable into the derived launch script.",
        f"the dump is enabled by {ENV_CONFIG}=<msprobe config.json with dump_path>; unset, the patched "
        "runner behaves as before and never imports msprobe.",
        "eager execution is required (actor_rollout_ref.rollout.enforce_eager=True); the runner refuses "
        "to start otherwise.",
        "output: {dump_path}/{pid}/step{N}/rank{R}/dump.json per model step and "
        "{dump_path}/{pid}/dispatch_log.jsonl (one line per dumped step).",
    ),
)

SETS = (VLLM_DUMP,)

"""Upstream vLLM V2 model runner: one msprobe step per model step in its `GPUModelRunner.execute_model`.

vLLM's V2 runner (`vllm/v1/worker/gpu/model_runner.py`) runs beside the V1 runner up to 0.33.0 (chosen
by `VLLM_USE_V2_MODEL_RUNNER`, or by vLLM's own `use_v2_model_runner` when unset) and is the only
runner from 0.34.0 (the V1 file is gone). Where both are in the tree both are patched: either dumps.
The four kinds of marked lines of the V1 codemod plus one (`vllm_model_runner.py`), calling the same
helper (`vllm/v1/worker/rl_msprobe_dump.py`):

- after the imports: `from vllm.v1.worker import rl_msprobe_dump`;
- last line of `GPUModelRunner.__init__`: `rl_msprobe_dump.init_runner(self)` (eager check, config);
- outermost decorator on `execute_model`: `@rl_msprobe_dump.dump_step` (stop + step in a `finally`,
  on every way out; the V2 runner's own dummy runs, `dummy_run=True`, are never dumped);
- before the statement that runs the eager forward, `model_output = self.model(**model_inputs)`:
  `rl_msprobe_dump.start_forward(self, input_batch)` — the step's `InputBatch` (a local of
  `execute_model`, anchored: its requests in row order, scheduled and computed tokens) lays out the
  per-token records' rows. The CUDA-graph replays beside it never run under `enforce_eager=True`,
  which the helper requires;
- outermost decorator on `sample_tokens`: `@rl_msprobe_dump.sample_step`. The V2 runner computes
  the logits there, after `execute_model` returns: the per-token record of the step stays open
  until `sample_tokens` ends (on every way out), so it holds the logits too.

msprobe's dump covers the model forward of a V2 step without the logits (V1: forward and logits). vLLM's CPU runner on x86
(`vllm/v1/worker/cpu/model_runner.py`, 0.34) subclasses this class without overriding
`execute_model`. Shape checked on vLLM 0.24.0, 0.30.0, 0.32.0, 0.33.0 and 0.34.0: the eager forward
is `self.model(**model_inputs)` in the innermost `else` of the "Run model" block throughout.

Earlier rl-msprobe put a guard here instead (`# rl-msprobe:vllm-v2-runner-guard`, the V2 runner
refused to start while a dump was asked for); those lines count as this codemod's, so `patch revert`
takes them out and `patch status` shows such a file as needing a revert and a new apply.
"""

from __future__ import annotations

from rl_msprobe.codemods.base import MARKER_PREFIX
from rl_msprobe.codemods.vllm_model_runner import RunnerCodemod

FORWARD_CALL = "self.model"
FORWARD_ANCHOR = "eager model forward in execute_model"
LEGACY_MARKER = f"{MARKER_PREFIX}vllm-v2-runner-guard"


class VllmModelRunnerV2(RunnerCodemod):
    name = "vllm-v2-model-runner"
    path = "vllm/v1/worker/gpu/model_runner.py"
    forward_call = FORWARD_CALL
    forward_anchor = FORWARD_ANCHOR
    passes_batch = True
    decorates_sampling = True

    def is_marked(self, source: str) -> bool:
        return bool(self.marked_lines(source))

    def _is_marked_line(self, line: str) -> bool:
        end = line.rstrip("\r\n").rstrip()
        return end.endswith(self.marker) or end.endswith(LEGACY_MARKER)

"""The live verl 0.9.1 GRPO job of tests/support/live_job.py with SGLang as its rollout
(``actor_rollout_ref.rollout.name=sglang``), on this CPU machine.

Same job (in-process Ray, FSDP2 actor, reward, old log-prob, advantage, actor update, weight
sync), same tiny Qwen2 and data, same CPU platform module, in the verl + SGLang 0.5.12 venv
(tests/support/sglang_job_venv.py). What the SGLang server needs on CPU, as a user would write
it in the launch script (``engine_kwargs.sglang`` override verl's server arguments):

- ``device=cpu``, ``attention_backend=torch_native`` (verl defaults to flashinfer on >= 0.5.12);
- ``max_total_tokens``: the KV cache capped (DOMAIN §12: else a share of host RAM);
- ``enable_memory_saver=False``: verl hard-codes True and SGLang then imports
  ``torch_memory_saver``, a CUDA-only package (``ModuleNotFoundError`` at launch).

and ``SGLANG_USE_CPU_ENGINE=1`` in the environment.

The tiny Qwen2's tokenizer defines ``<|im_start|>`` / ``<|im_end|>`` (as a real Qwen2's does):
verl 0.9.1's agent loop builds its Qwen token builder for model_type qwen2 and requires them
(``ValueError: Tokenizer does not define required token '<|im_end|>'``); the transformers this
venv holds (5.6.0, SGLang 0.5.12's pin) says so, where the job venv's 5.19 silently maps it to 0.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import live_job, vllm_cpu
from tests.support.sglang_job_venv import VENV

KV_TOKENS = 4096
SGLANG = "actor_rollout_ref.rollout.engine_kwargs.sglang."
# the vLLM-only lines of live_job.OVERRIDES, by key, replaced for an SGLang rollout
REPLACE = {
    "actor_rollout_ref.rollout.name": "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.enable_sleep_mode": f"+{SGLANG}device=cpu",
    # HYBRID sleep / wake: verl releases the server's weights and KV cache after each rollout
    # and resumes them around the weight sync (without the memory saver nothing is freed on CPU,
    # but SGLang's release / resume path runs: the static-state stash and restore of the weights)
    "actor_rollout_ref.rollout.free_cache_engine": "actor_rollout_ref.rollout.free_cache_engine=True",
}
ENGINE_KWARGS = (
    f"+{SGLANG}attention_backend=torch_native",
    f"+{SGLANG}max_total_tokens={KV_TOKENS}",
    f"+{SGLANG}enable_memory_saver=False",
)
ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
_CHATML = 'fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})\n'
_CHATML_SCRIPT = vllm_cpu._TINY_MODEL_SCRIPT.replace(
    'if options.get("full_vocab"):', _CHATML + 'if options.get("full_vocab"):', 1
)


def chatml_model(python: Path) -> Path:
    """live_job's tiny Qwen2 (same spec and seed) with the ChatML tokens in its tokenizer, cached."""
    options = {"full_vocab": True, "chat_template": live_job.CHAT_TEMPLATE, "chatml": True}
    dest = vllm_cpu.models_dir() / "tiny-qwen2-chatml-s0"
    expected = {"spec": vllm_cpu.TINY_MODEL, "seed": 0, "options": options}
    args = (json.dumps(vllm_cpu.TINY_MODEL), "0", json.dumps(options))
    return vllm_cpu.cached_folder(dest, expected, python, _CHATML_SCRIPT, *args, what="the tiny ChatML Qwen2")


def prepare_job(
    dest: Path, python: Path | None = None, steps: int = live_job.DEFAULT_STEPS, extra=()
) -> live_job.Job:
    """A job folder under DEST whose plain script runs the GRPO job with an SGLang rollout;
    pytest.skip loudly when the venv cannot be built here."""
    python = python or VENV.python_or_skip()
    dest.mkdir(parents=True, exist_ok=True)
    model = chatml_model(python)
    data = live_job.job_data(python)
    (dest / "reward.py").write_text(live_job.REWARD)
    text = live_job.plain_script(model, data, dest, steps, (*ENGINE_KWARGS, *extra), replace=REPLACE)
    script = dest / "run_tiny_grpo_sglang.sh"
    script.write_text(text.replace("vLLM CPU rollout", "SGLang CPU rollout"))
    script.chmod(0o755)
    pythonpath = dest / "pythonpath"
    pythonpath.mkdir(exist_ok=True)
    (pythonpath / f"{live_job.PLATFORM_MODULE}.py").write_bytes(live_job.PLATFORM_SOURCE.read_bytes())
    return live_job.Job(dest, python, model, data, pythonpath, script)


def run(
    job: live_job.Job, script: Path, timeout_s: int = live_job.DEFAULT_TIMEOUT_S, **kwargs
) -> live_job.JobResult:
    """live_job.run with the SGLang CPU environment."""
    return live_job.run(job, script, timeout_s, **{**ENV, **kwargs})


if __name__ == "__main__":  # python -m tests.support.sglang_job DIR: write a job and run its plain script
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rl-msprobe-sglang-job")
    made = prepare_job(target, python=VENV.build())
    result = run(made, made.script, int(sys.argv[2]) if len(sys.argv) > 2 else 1200)
    print(result.tail(4000))
    print(json.dumps(result.metrics, indent=1)[:3000])
    sys.exit(result.returncode)

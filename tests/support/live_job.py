"""A real verl 0.9.1 GRPO job on this CPU machine, for end-to-end tests (DOMAIN §8).

In-process Ray, the FSDP2 actor, the vLLM CPU server rollout, a reward function, old log-prob,
advantage, actor update and the real weight sync, run by ``python3 -m verl.trainer.main_ppo``
from a PLAIN user launch script (nothing rl-msprobe-specific) in the shared test venv
(``tests/support/job_venv.py``). What the CPU needs lives outside verl, in test code only:

- ``live_cpu_platform.py``, copied into the job's ``pythonpath/`` and named in
  ``VERL_USE_EXTERNAL_MODULES``: a "cpu" platform and the two runtime fixes (gloo backend; the
  weight sync inside vLLM's layerwise reload);
- a ``vllm-0.32.0+cpu.dist-info`` beside it, so that verl finds the distribution ``vllm``;
- the environment of ``job_env`` and the overrides of ``OVERRIDES`` in the script.

The tiny Qwen2 (vocab 512, hidden 128, 2 layers, fp32; ``len(tokenizer) == vocab``) and the
parquet data are cached under ``~/.cache/rl-msprobe``. One live job at a time on this machine
(~7.5 GB RAM, both cores): ``run`` holds ``~/.cache/rl-msprobe/live-job.lock`` and always runs
under ``timeout`` (a failed weight sync hangs the job), then kills what the job left behind.

Measured (2 cores shared with other sessions, 2026-11-30): the plain script, 2 steps, exit 0
in 409 s wall (start-up of Ray, the workers and vLLM ~320 s, step 1 77 s, step 2 2 s;
``rollout_probs_diff_mean`` 2e-5; a second run 456 s); the first run also makes the model and
data (~20 s). Under the load of other sessions' jobs a run has taken 18 min: hence the timeout.

    from tests.support import live_job
    job = live_job.prepare_job(tmp_path)             # pytest.skip loudly if no venv
    result = live_job.run(job, job.script)           # or a derived script
    assert result.returncode == 0, result.tail()
    result.metrics[2]["training/rollout_probs_diff_mean"]

Test-only code inside the job's processes: ``run(..., worker_modules=["my_mod"],
pythonpath=[dir])`` imports ``my_mod`` in every verl process; its ``after_weight_sync(worker)``
runs in the vLLM worker after each weight sync (``worker.model_runner.model``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import vllm_cpu
from tests.support.job_venv import VENV

PLATFORM_MODULE = "live_cpu_platform"
PLATFORM_SOURCE = Path(__file__).with_name("live_cpu_platform.py")
MARKER_VAR = "RL_MSPROBE_LIVE_JOB_ID"  # in every process of a job: finds what it leaves behind
WORKER_MODULES_VAR = "RL_MSPROBE_LIVE_WORKER_MODULES"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
DATA_VERSION = 1
TRAIN_ROWS, VAL_ROWS = 32, 4
DEFAULT_STEPS = 2
DEFAULT_TIMEOUT_S = 1500  # ~7 min alone; a loaded shared machine has taken 18

# verl's overrides for this machine (DOMAIN §8): in the script as a user would write them
OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_files=$DATA_DIR/train.parquet",
    "data.val_files=$DATA_DIR/val.parquet",
    "data.train_batch_size=2",
    "data.max_prompt_length=64",
    "data.max_response_length=16",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.model.path=$MODEL_PATH",
    "actor_rollout_ref.model.use_remove_padding=True",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.fsdp_config.dtype=float32",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "+actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
    "actor_rollout_ref.rollout.max_model_len=128",
    "actor_rollout_ref.rollout.max_num_seqs=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "reward.custom_reward_function.path=$JOB_DIR/reward.py",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "+ray_kwargs.ray_init.num_gpus=1",
    "ray_kwargs.ray_init.num_cpus=8",
    "+ray_kwargs.ray_init.include_dashboard=False",
    "trainer.logger='[console]'",
    "trainer.project_name=tiny_grpo_cpu",
    "trainer.experiment_name=tiny_qwen2_grpo",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.total_epochs=1",
)

REWARD = '''"""Reward for the tiny GRPO job: the share of answer letters in the response (it varies
between samples, so GRPO's advantages and the policy loss are not all zero)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(c in ground_truth for c in solution_str) / max(1, len(solution_str))
'''

_DATA_SCRIPT = r"""
import json, sys
import pandas as pd
from pathlib import Path
out = sys.argv[1]; rows = json.loads(sys.argv[2])
words = ("the a model rollout prefill decode tensor layer rank step dump probe engine token "
         "request batch train infer compare cosine error value cache query key attention").split()
for split, n in rows.items():
    records = []
    for i in range(n):
        answer = words[(i * 5) % len(words)]
        text = " ".join(words[(i * 3 + j * 7) % len(words)] for j in range(4 + i % 5))
        records.append({
            "data_source": "tiny_words",
            "prompt": [{"role": "user", "content": f"repeat {answer}: {text}"}],
            "ability": "words",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i, "split": split},
        })
    Path(out).mkdir(parents=True, exist_ok=True)
    pd.DataFrame(records).to_parquet(f"{out}/{split}.parquet")
"""

_METRIC_LINE = re.compile(r"\bstep:(\d+) - (.*)$")
_VALUE = re.compile(r"^\s*(?:np\.\w+\()?([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))\)?\s*$")


@dataclass(frozen=True)
class Job:
    """A job folder: the plain launch script and what it needs, plus the venv's python."""

    root: Path
    python: Path
    model: Path
    data: Path
    pythonpath: Path  # the platform module and the vllm dist-info shim
    script: Path  # the plain user launch script


@dataclass
class JobResult:
    returncode: int
    log: str
    wall_s: float
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> verl's console metrics
    log_path: Path | None = None

    @property
    def timed_out(self) -> bool:
        return self.returncode in (124, 137)

    def tail(self, chars: int = 6000) -> str:
        return f"exit {self.returncode} after {self.wall_s:.0f} s; log {self.log_path}:\n{self.log[-chars:]}"


def cache_dir() -> Path:
    return VENV.venv_dir().parent.parent  # ~/.cache/rl-msprobe


def parse_metrics(log: str) -> dict[int, dict[str, float]]:
    """verl's console metric lines (`step:N - key:value - ...`, maybe behind a Ray prefix)."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        match = _METRIC_LINE.search(line)
        if not match:
            continue
        values = steps.setdefault(int(match.group(1)), {})
        for item in match.group(2).split(" - "):
            key, sep, raw = item.rpartition(":")
            number = _VALUE.match(raw)  # 0.5, 1e-05, nan, np.float64(2.0), np.int32(2)
            if sep and key.strip() and number:
                values[key.strip()] = float(number.group(1))
    return steps


def job_model(python: Path) -> Path:
    """The tiny Qwen2 of DOMAIN §8 (tokenizer padded to the vocab, a chat template), cached."""
    return vllm_cpu.tiny_model(python=python, full_vocab=True, chat_template=CHAT_TEMPLATE)


QWEN3_MODEL = {
    **vllm_cpu.TINY_MODEL,
    "num_hidden_layers": 3,
    "head_dim": 32,  # the CPU attention needs >= 32
}
_QWEN3_SCRIPT = (
    vllm_cpu._TINY_MODEL_SCRIPT.replace("Qwen2Config", "Qwen3Config")
    .replace("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    .replace(
        'if options.get("full_vocab"):',
        'fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})\n'
        'if options.get("full_vocab"):',
    )
)


def qwen3_model(python: Path) -> Path:
    """A tiny random Qwen3 (q_norm / k_norm, 3 layers) whose tokenizer defines <|im_start|> and
    <|im_end|> (verl 0.9.1's Qwen3 logic raises without them; DOMAIN §9), cached."""
    options = {"full_vocab": True, "chat_template": CHAT_TEMPLATE, "chatml": True}
    dest = vllm_cpu.models_dir() / "tiny-qwen3-chatml-s0"
    expected = {"spec": QWEN3_MODEL, "seed": 0, "options": options}
    args = (json.dumps(QWEN3_MODEL), "0", json.dumps(options))
    return vllm_cpu.cached_folder(dest, expected, python, _QWEN3_SCRIPT, *args, what="the tiny Qwen3")


QWEN3_MOE_MODEL = {
    **QWEN3_MODEL,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_QWEN3_MOE_SCRIPT = _QWEN3_SCRIPT.replace("Qwen3Config", "Qwen3MoeConfig").replace(
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
)


def qwen3_moe_model(python: Path) -> Path:
    """A tiny random Qwen3-MoE (3 layers, each a sparse MoE block of 8 experts, top-2) with the
    tokenizer of `qwen3_model`, cached: vLLM CPU 0.32 runs it (its CPU MoE backend)."""
    options = {"full_vocab": True, "chat_template": CHAT_TEMPLATE, "chatml": True}
    dest = vllm_cpu.models_dir() / "tiny-qwen3-moe-chatml-s0"
    expected = {"spec": QWEN3_MOE_MODEL, "seed": 0, "options": options}
    args = (json.dumps(QWEN3_MOE_MODEL), "0", json.dumps(options))
    return vllm_cpu.cached_folder(dest, expected, python, _QWEN3_MOE_SCRIPT, *args, what="the tiny Qwen3-MoE")


def job_data(python: Path) -> Path:
    """train.parquet / val.parquet for the tiny job, made once with the venv's pandas."""
    rows = {"train": TRAIN_ROWS, "val": VAL_ROWS}
    dest = cache_dir() / "data" / f"live-grpo-v{DATA_VERSION}"
    return vllm_cpu.cached_folder(dest, rows, python, _DATA_SCRIPT, json.dumps(rows), what="the job data")


def vllm_version(python: Path) -> str:
    return vllm_cpu.venv_print(python, "import importlib.metadata as m; print(m.version('vllm-cpu'))")


def write_pythonpath(dest: Path, python: Path) -> Path:
    """The platform module and the `vllm-<v>+cpu.dist-info` shim (verl looks up `vllm`)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLATFORM_SOURCE, dest / f"{PLATFORM_MODULE}.py")
    version = vllm_version(python)
    shim = dest / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return dest


def _override_key(line: str) -> str:
    return line.split("=", 1)[0].lstrip("+")


def variant_overrides(ranks: int = 1, dtype: str = "float32") -> dict[str, str]:
    """Overrides that replace the standard ones for RANKS devices (rollout TP = RANKS, DOMAIN §9)
    and a DTYPE on both sides (the actor's fp32 master weights stay; prepare aligns param_dtype)."""
    out: dict[str, str] = {}
    if ranks != 1:
        out.update(
            {
                "trainer.n_gpus_per_node": f"trainer.n_gpus_per_node={ranks}",
                "ray_kwargs.ray_init.num_gpus": f"+ray_kwargs.ray_init.num_gpus={ranks}",
                "actor_rollout_ref.rollout.tensor_model_parallel_size": (
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={ranks}"
                ),
            }
        )
    if dtype != "float32":
        out["actor_rollout_ref.rollout.dtype"] = f"actor_rollout_ref.rollout.dtype={dtype}"
    return out


def plain_script(
    model: Path,
    data: Path,
    job_dir: Path,
    steps: int = DEFAULT_STEPS,
    extra: tuple[str, ...] = (),
    *,
    replace: dict[str, str] | None = None,
    exports: dict[str, str] | None = None,
    model_name: str = "Qwen2",
) -> str:
    """The user's launch script: plain verl, the machine's overrides, nothing of rl-msprobe.
    REPLACE: override lines by key (`variant_overrides`); EXPORTS: `export K='V'` lines."""
    replace = replace or {}
    lines = [replace.get(_override_key(line), line) for line in OVERRIDES]
    lines += [v for k, v in replace.items() if k not in {_override_key(line) for line in OVERRIDES}]
    lines += [f"trainer.total_training_steps={steps}", *extra]
    body = " \\\n".join(f"    {line}" for line in lines)
    exported = "".join(f"export {k}='{v}'\n" for k, v in (exports or {}).items())
    return (
        "#!/usr/bin/env bash\n"
        f"# GRPO on a tiny {model_name}, CPU only: FSDP2 actor + vLLM CPU rollout (verl 0.9.1).\n"
        "set -xeuo pipefail\n\n"
        f"{exported}"
        f"MODEL_PATH={model}\n"
        f"DATA_DIR={data}\n"
        f"JOB_DIR={job_dir}\n\n"
        f'python3 -m verl.trainer.main_ppo \\\n{body} \\\n    "$@"\n'
    )


def prepare_job(
    dest: Path,
    python: Path | None = None,
    steps: int = DEFAULT_STEPS,
    extra: tuple[str, ...] = (),
    *,
    ranks: int = 1,
    model: str = "qwen2",
    dtype: str = "float32",
) -> Job:
    """Write a job folder under DEST (script `run_tiny_grpo.sh`); pytest.skip loudly when the
    venv cannot be built here. EXTRA overrides go after the standard ones. RANKS devices (FSDP2
    world RANKS, one vLLM server with TP = RANKS; DOMAIN §9), MODEL qwen2, qwen3 (tiny, with
    q_norm/k_norm and the ChatML tokens verl's Qwen3 logic needs) or qwen3-moe (the same, MoE), DTYPE of the rollout."""
    python = python or VENV.python_or_skip()
    dest.mkdir(parents=True, exist_ok=True)
    makers = {"qwen3": qwen3_model, "qwen3-moe": qwen3_moe_model}
    model_dir = makers.get(model, job_model)(python)
    data = job_data(python)
    (dest / "reward.py").write_text(REWARD)
    script = dest / "run_tiny_grpo.sh"
    # one NUMA node here: vLLM's `auto` binding asserts one node per local TP worker (DOMAIN §9)
    exports = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % 2) for i in range(ranks))} if ranks > 1 else {}
    text = plain_script(
        model_dir,
        data,
        dest,
        steps,
        extra,
        replace=variant_overrides(ranks, dtype),
        exports=exports,
        model_name={"qwen3": "Qwen3", "qwen3-moe": "Qwen3-MoE"}.get(model, "Qwen2"),
    )
    script.write_text(text)
    script.chmod(0o755)
    return Job(dest, python, model_dir, data, write_pythonpath(dest / "pythonpath", python), script)


def job_env(job: Job, marker: str, pythonpath=(), worker_modules=(), **extra: str) -> dict[str, str]:
    """DOMAIN §8's environment: the venv first on PATH, the platform module on PYTHONPATH."""
    env = {k: v for k, v in vllm_cpu.engine_env().items() if not k.startswith(("RAY_", "VERL_"))}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the job's vLLM server runs its engine core apart
    env.pop("PYTHONHOME", None)
    env.update(
        PATH=f"{job.python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(job.python.parent.parent),
        PYTHONPATH=os.pathsep.join([str(job.pythonpath), *map(str, pythonpath)]),
        VERL_USE_EXTERNAL_MODULES=PLATFORM_MODULE,
        VERL_PLATFORM="cpu",
        VERL_ENGINE_DEVICE="cuda",  # verl registers the FSDP engine for cuda/npu only
        VLLM_TARGET_DEVICE="cpu",
        RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
    )
    env[MARKER_VAR] = marker
    if worker_modules:
        env[WORKER_MODULES_VAR] = ",".join(worker_modules)
    env.update(extra)
    return env


def lock_path() -> Path:
    return cache_dir() / "live-job.lock"


_HELD = threading.local()  # flock is per open file: a thread re-enters without a second open


@contextlib.contextmanager
def live_job_lock():
    """One live job at a time on this machine (~7.5 GB RAM, both cores); re-entrant in a process.
    A test that patches the shared venv takes vllm_cpu.patch_lock() first, then this one."""
    if getattr(_HELD, "depth", 0):
        _HELD.depth += 1
        try:
            yield
        finally:
            _HELD.depth -= 1
        return
    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _HELD.depth = 1
        try:
            yield
        finally:
            _HELD.depth = 0
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pids_with_marker(marker: str) -> list[int]:
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def _kill_leftovers(marker: str) -> list[int]:
    """Ray's daemons and workers may outlive a killed driver: end every process of this job."""
    pids = _pids_with_marker(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
            time.sleep(0.2)
    return pids


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return (Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]) != "Z"
    return False


def run(
    job: Job,
    script: Path,
    timeout_s: int = DEFAULT_TIMEOUT_S,
    *,
    args: tuple[str, ...] = (),
    pythonpath: tuple[Path, ...] = (),
    worker_modules: tuple[str, ...] = (),
    cwd: Path | None = None,
    **env: str,
) -> JobResult:
    """Run SCRIPT (the plain one or a derived one) with bash under `timeout`, with the job's
    environment (plus ENV), holding the live-job lock; the log goes to `<script>.log`."""
    marker = uuid.uuid4().hex
    log_path = script.with_suffix(".log")
    environ = job_env(job, marker, pythonpath, worker_modules, **env)
    command = ["timeout", "-k", "30", str(timeout_s), "bash", str(script), *args]
    with live_job_lock():
        started = time.monotonic()
        try:
            with log_path.open("wb") as log:
                proc = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=cwd or job.root
                )
        finally:
            wall = time.monotonic() - started
            _kill_leftovers(marker)
    text = log_path.read_text(errors="replace")
    return JobResult(proc.returncode, text, wall, parse_metrics(text), log_path)


if __name__ == "__main__":  # python -m tests.support.live_job DIR: write a job and run its plain script
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rl-msprobe-live-job")
    made = prepare_job(target, python=VENV.build())
    result = run(made, made.script)
    print(result.tail(3000))
    print(json.dumps(result.metrics, indent=1)[:3000])
    sys.exit(result.returncode)

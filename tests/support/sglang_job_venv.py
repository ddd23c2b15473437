"""The cached venv for verl 0.9.1's GRPO job with an SGLang rollout on CPU (DOMAIN §8, §12).

verl 0.9.1's ``sglang`` extra pins ``sglang==0.5.12``; the two SGLang test venvs
(tests/support/sglang_venv.py) hold 0.5.10.post1 and 0.5.23, and verl 0.9.1 cannot run 0.5.23
(``dataclasses.fields(ServerArgs)``: ServerArgs is no longer a dataclass). So this third venv is
SGLang at verl's pin with verl's runtime needs, without vLLM: the SGLang CPU recipe of
sglang_venv.py (the CPU ``torch`` held in every step, ``--no-deps`` sglang, its pure-Python
needs, the torchvision guard and the ``sgl_kernel`` Python files as fixups), then the verl needs
of tests/support/job_venv.py and ``--no-deps verl==0.9.1``.

Built once under ``~/.cache/rl-msprobe/venvs/verl-sglang-0.5.12-cpu`` behind a file lock
(override: ``RL_MSPROBE_SGLANG_JOB_VENV``), ~4 GB.

    python -m tests.support.sglang_job_venv build
"""

from __future__ import annotations

from tests.support import job_venv
from tests.support.sglang_venv import COMMON, FIXUP_VERSION, TORCH, TORCHVISION, TV_GUARDED, make_fixup
from tests.support.venvs import CachedVenv, main

SGLANG = "0.5.12"  # verl 0.9.1's `sglang` extra
KERNEL = "0.4.2.post2"  # the sglang-kernel 0.5.12 requires (its .py files only)
SGLANG_NEEDS = (
    "transformers==5.6.0", "xgrammar==0.2.0", "openai==2.6.1", "llguidance<0.8.0,>=0.7.11",
    "apache-tvm-ffi==0.1.9", "smg-grpc-servicer>=0.5.0", "compressed-tensors", "easydict",
)  # fmt: skip
VERL_NEEDS = ("cachetools",)  # verl's rollout router imports it; the job venv gets it with vLLM
STEPS = (
    ("install", "-q", "--upgrade", "pip"),
    ("install", "-q", TORCH),
    ("install", "-q", "--no-deps", f"sglang=={SGLANG}", TORCHVISION),
    ("install", "-q", TORCH, *COMMON, *SGLANG_NEEDS, *job_venv.DEPS, *VERL_NEEDS),
    ("install", "-q", "--no-deps", job_venv.VERL),
)
CHECK = (
    "import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'; "
    "import torch, tensordict, ray, transfer_queue, verl, msprobe, sglang; "
    "from sglang.srt.entrypoints.http_server import launch_server; "
    "from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer; "
    "from verl.trainer.ppo.v1 import get_trainer_cls; "
    "print(verl.__version__, sglang.__version__, torch.__version__)"
)
RECIPE = {
    "steps": [list(s) for s in STEPS],
    "check": CHECK,
    "fixup": {"torchvision_guard": TV_GUARDED, "sgl_kernel": KERNEL, "v": FIXUP_VERSION},
}

VENV = CachedVenv(
    name=f"verl-sglang-{SGLANG}-cpu",
    path_var="RL_MSPROBE_SGLANG_JOB_VENV",
    skip_var="RL_MSPROBE_SKIP_SGLANG_E2E",
    skip_label=f"REAL verl + SGLang {SGLANG} CPU JOB",
    steps=STEPS,
    check=CHECK,
    recipe=RECIPE,
    min_free_gb=10,
    fixup=make_fixup(KERNEL),
)

python_or_skip = VENV.python_or_skip

if __name__ == "__main__":
    main(VENV, "sglang_job_venv")

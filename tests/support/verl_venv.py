"""A cached CPU test venv that runs verl's real training engines (DOMAIN §7).

Recipe: ``torch==2.13.0`` (the CPU wheel lies on local disk here), verl's runtime needs
(ray, tensordict 0.10.0, omegaconf, transformers 5.10.4, peft, datasets, ...) and the real
msprobe (``mindstudio-probe``) in one resolve, then ``--no-deps`` ``verl==0.9.1`` (its
``verl[cpu]`` extra pins another torch) and ``megatron-core==0.16.1`` (imports on CPU).
Other verl releases are not installed: tests put a patched copy first on ``PYTHONPATH``.
The venv is clean (no system site-packages), built once under
``~/.cache/rl-msprobe/venvs/verl-cpu`` (override: ``RL_MSPROBE_VERL_VENV``) behind a file
lock; a stamp written last records the recipe, and a changed recipe rebuilds it.

    python -m tests.support.verl_venv build     # ahead of time, e.g. in the background
"""

from __future__ import annotations

from tests.support.venvs import CachedVenv, VenvUnavailable, main

TORCH = "torch==2.13.0"
VERL = "verl==0.9.1"
MEGATRON = "megatron-core==0.16.1"
MSPROBE = "mindstudio-probe"
DEPS = (
    "packaging",
    "numpy",
    "ray",
    "tensordict==0.10.0",
    "omegaconf",
    "transformers==5.10.4",
    "peft",
    "datasets",
    "pillow",
    "codetiming",
    "orjson",
)
STEPS = (
    ("install", TORCH, *DEPS, MSPROBE),
    ("install", "--no-deps", VERL, MEGATRON),
)
CHECK = (
    "import torch, tensordict, ray, verl, msprobe, megatron.core; print(verl.__version__, torch.__version__)"
)
RECIPE = {"steps": [list(s) for s in STEPS], "check": CHECK, "v": 1}

VENV = CachedVenv(
    name="verl-cpu",
    path_var="RL_MSPROBE_VERL_VENV",
    skip_var="RL_MSPROBE_SKIP_VERL_E2E",
    skip_label="REAL verl ENGINE RUNS",
    steps=STEPS,
    check=CHECK,
    recipe=RECIPE,
    min_free_gb=5,  # the venv is ~2.5 GB, plus pip's unpack room
)

__all__ = ["VENV", "VenvUnavailable", "build", "venv_python_or_skip"]
build = VENV.build
venv_python_or_skip = VENV.python_or_skip

if __name__ == "__main__":
    main(VENV, "verl_venv")

"""The cached CPU test venv that runs verl's real training engines (DOMAIN §7).

It is the one shared test venv of ``tests/support/job_venv.py`` (verl 0.9.1, megatron-core,
vLLM CPU, Ray, TransferQueue, msprobe). Other verl releases are not installed: tests put a
patched copy first on ``PYTHONPATH``.

    python -m tests.support.job_venv build     # ahead of time, e.g. in the background
"""

from __future__ import annotations

from tests.support.job_venv import VENV, build, venv_python_or_skip
from tests.support.venvs import VenvUnavailable

__all__ = ["VENV", "VenvUnavailable", "build", "venv_python_or_skip"]

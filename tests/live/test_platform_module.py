"""The CPU platform module of the live job, loaded the way verl loads it (VERL_USE_EXTERNAL_MODULES)
in the shared venv, without a job: device and backend, the gloo default of the process group, and
the weight-sync wrapper (vLLM's layerwise reload around verl's sync, then the test hook).
vLLM's reload functions and verl's sync are replaced by recorders: no engine runs here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import job_venv, live_job

pytestmark = pytest.mark.e2e

PROBE = r"""
import json, types
import verl
from verl.utils import distributed as dist_utils
from verl.utils.device import get_device_name, get_nccl_backend
from verl.workers.rollout.vllm_rollout import utils as rollout_utils
import vllm.model_executor.model_loader.reload as reload
import torch.distributed

calls = []
reload.initialize_layerwise_reload = lambda model: calls.append(("init", model))
reload.finalize_layerwise_reload = lambda model, config: calls.append(("finalize", model, config))
sync = rollout_utils.vLLMColocateWorkerExtension.update_weights_from_ipc
sync.__wrapped__ = lambda self, *a, **k: calls.append(("sync",))
runner = types.SimpleNamespace(model="M", vllm_config=types.SimpleNamespace(model_config="C"))
sync(types.SimpleNamespace(model_runner=runner))
dist_utils.initialize_global_process_group_ray()
import plant_hook
print("RESULT " + json.dumps({
    "device": get_device_name(), "backend": get_nccl_backend(), "calls": calls, "hook": plant_hook.seen,
    "pg_backend": str(torch.distributed.get_backend()),
}))
"""


def test_platform_module_as_verl_loads_it(tmp_path: Path):
    python = job_venv.venv_python_or_skip()
    job = live_job.Job(
        tmp_path, python, tmp_path, tmp_path, live_job.write_pythonpath(tmp_path / "pp", python), tmp_path
    )
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "plant_hook.py").write_text(
        "seen = []\n\n\ndef after_weight_sync(worker):\n    seen.append(worker.model_runner.model)\n"
    )
    env = live_job.job_env(job, "probe", pythonpath=(tmp_path / "hooks",), worker_modules=("plant_hook",))
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert (out["device"], out["backend"], out["pg_backend"]) == ("cpu", "gloo", "gloo")
    assert out["calls"] == [["init", "M"], ["sync"], ["finalize", "M", "C"]]
    assert out["hook"] == ["M"]  # the test hook ran after the sync, in this (the vLLM worker's) process

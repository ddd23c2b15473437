"""The job-side helper file (patches/files/verl/verl/utils/rl_msprobe_weights.py), loaded as a
module by path: the same code that fingerprints inside a job fingerprints here."""

from __future__ import annotations

import importlib.util
from importlib import resources

PATH = resources.files("rl_msprobe.patches").joinpath(
    "files", "verl", "verl", "utils", "rl_msprobe_weights.py"
)


def load():
    spec = importlib.util.spec_from_file_location("rl_msprobe_weights_under_test", str(PATH))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_worker(helper, model):
    """A vLLM worker extension as verl-weights patches it: the sync entry decorated, the bucket
    fingerprinted as received before the model loads it."""

    class Worker:
        def __init__(self):
            self.model_runner = type("Runner", (), {"model": model})()

        @helper.engine_sync
        def update_weights_from_ipc(self, weights):
            helper.received(self, weights)
            model.load_weights(weights)

    return Worker()

"""Test-only: tests/support/live_plant.py's ``after_weight_sync`` inside SGLang's scheduler process.

verl imports its external modules (the CPU platform, ``worker_modules``) in its own processes
only; SGLang's scheduler, which holds the rollout model, is a spawned subprocess that imports
SGLang and nothing of verl. So a live SGLang job (tests/support/sglang_job.py) copies this file as
``sitecustomize.py`` into a folder on ``PYTHONPATH``: Python imports it at start-up in every
process of the job. It does nothing unless ``RL_MSPROBE_PLANT`` is set, and then only watches for
SGLang's ``model_runner`` module: ``ModelRunner.update_weights_from_tensor`` (what verl's weight
sync calls, one call per bucket; the tiny model is one bucket) gets ``live_plant.after_weight_sync``
after it, with the runner as ``worker.model_runner``.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "sglang.srt.model_executor.model_runner"


def _wrap(module) -> None:
    cls = module.ModelRunner
    original = cls.update_weights_from_tensor

    def update_weights_from_tensor(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        import types

        import live_plant

        live_plant.after_weight_sync(types.SimpleNamespace(model_runner=self))
        return result

    cls.update_weights_from_tensor = update_weights_from_tensor


class _AfterSGLangRunner(importlib.abc.MetaPathFinder):
    """One-shot: finds SGLang's model_runner through the other finders, then wraps it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # the module loads once per process
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (load(module), _wrap(module))[0]
        return spec


if os.environ.get("RL_MSPROBE_PLANT"):
    sys.meta_path.insert(0, _AfterSGLangRunner())

"""Test-only: tests/support/live_plant.py's ``after_weight_sync`` inside SGLang's scheduler process.

verl imports its external modules (the CPU platform, ``worker_modules``) in its own processes
only; SGLang's scheduler, which holds the rollout model, is a spawned subprocess that imports
SGLang and nothing of verl. So a live SGLang job (tests/support/sglang_job.py) copies this file as
``sitecustomize.py`` into a folder on ``PYTHONPATH``: Python imports it at start-up in every
process of the job. It does nothing unless ``RL_MSPROBE_PLANT`` is set, and then only watches for
SGLang's ``model_runner`` module: ``ModelRunner.update_weights_from_tensor`` (what verl's weight
sync calls, one call per bucket; the tiny model is one bucket) gets ``live_plant.after_weight_sync``
after it, with the runner as ``worker.model_runner``. It also notes verl's HYBRID sleep and wake
(the scheduler's ``release_memory_occupation`` / ``resume_memory_occupation``, with their tags)
as lines ``{"pid", "memory": "release"|"resume", "tags"}`` in ``RL_MSPROBE_PLANT_LOG``.
"""

import importlib.abc
import importlib.util
import json
import os
import sys

RUNNER = "sglang.srt.model_executor.model_runner"
SCHEDULER_MIXIN = "sglang.srt.managers.scheduler_update_weights_mixin"


def _note(event: str, request) -> None:
    path = os.environ.get("RL_MSPROBE_PLANT_LOG")
    if path:
        with open(path, "a") as handle:
            tags = getattr(request, "tags", None)
            handle.write(json.dumps({"pid": os.getpid(), "memory": event, "tags": tags}) + "\n")


def _wrap_memory(module) -> None:
    cls = module.SchedulerUpdateWeightsMixin
    for event in ("release", "resume"):
        name = f"{event}_memory_occupation"
        original = getattr(cls, name)

        def method(self, request, *args, _original=original, _event=event, **kwargs):
            result = _original(self, request, *args, **kwargs)
            _note(_event, request)
            return result

        setattr(cls, name, method)


def _wrap_runner(module) -> None:
    cls = module.ModelRunner
    original = cls.update_weights_from_tensor

    def update_weights_from_tensor(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        import types

        import live_plant

        live_plant.after_weight_sync(types.SimpleNamespace(model_runner=self))
        return result

    cls.update_weights_from_tensor = update_weights_from_tensor


WRAP = {RUNNER: _wrap_runner, SCHEDULER_MIXIN: _wrap_memory}


class _AfterSGLangRunner(importlib.abc.MetaPathFinder):
    """Finds SGLang's modules through the other finders, then wraps each once loaded."""

    def __init__(self) -> None:
        self.pending = dict(WRAP)

    def find_spec(self, name, path, target=None):
        wrap = self.pending.pop(name, None)
        if wrap is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (load(module), wrap(module))[0]
        return spec


if os.environ.get("RL_MSPROBE_PLANT"):
    sys.meta_path.insert(0, _AfterSGLangRunner())

"""A CPU platform for verl 0.9.1 plus the two runtime fixes a live GRPO job needs on CPU (DOMAIN §8).

Test code only: ``tests/support/live_job.py`` copies this file into a job folder that it puts
on ``PYTHONPATH`` and names in ``VERL_USE_EXTERNAL_MODULES``, so that verl imports it in every
process of the job (driver, Ray workers, the vLLM engine process). Nothing in verl's files is
edited; the fixes wrap functions when their modules are first imported:

1. verl builds the process-group backend ``"cpu:gloo,cpu:gloo"`` on this platform, which torch
   rejects: ``initialize_global_process_group_ray`` gets ``backend="gloo"`` by default.
2. vLLM CPU repacks linear weights after loading and drops ``weight_loader``, so verl's weight
   sync fails (and the job then hangs): the sync runs inside vLLM's own layerwise reload.
3. SGLang rollout (tests/support/sglang_job.py): SGLang's torch-reduction patch
   (``sglang.srt.utils.patch_torch._reduce_tensor_modified``, applied by its weight sync) swaps
   the device index of a CUDA tensor's IPC handle for the device's UUID, at a fixed slot that a
   CPU tensor's reduction does not have (``IndexError: tuple index out of range`` in verl's
   ``update_weights``): CPU tensors keep torch's own reduction, and a process that imports it
   shares CPU storages with the ``file_system`` strategy: the default passes a file descriptor through ``multiprocessing``'s
   resource sharer, which the SGLang scheduler (spawned by another Ray actor, another authkey)
   is refused (``AuthenticationError: digest sent was rejected``); a named shared-memory file
   needs no handshake.

Test hook: ``RL_MSPROBE_LIVE_WORKER_MODULES`` names modules (comma-separated, on
``PYTHONPATH``) imported here in every process; a module's ``after_weight_sync(worker)`` runs
in the vLLM worker after each weight sync (``worker.model_runner.model`` is the rollout model),
e.g. to perturb one layer on the rollout side only; its ``before_weight_sync(worker)``, if any,
runs before each sync (e.g. to wrap the worker's ``_update_weights`` or the model's
``load_weights`` for that sync).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import os
import sys
import types
from contextlib import contextmanager

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

WORKER_MODULES_VAR = "RL_MSPROBE_LIVE_WORKER_MODULES"


def _noop(*_args, **_kwargs):
    return None


def _zero(*_args, **_kwargs):
    return 0


def _mem_get_info(*_args, **_kwargs):
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size, os.sysconf("SC_PHYS_PAGES") * size


def _device_module() -> types.ModuleType:
    """torch.cpu plus the memory / seed / IPC calls verl makes on its device module, as no-ops."""
    module = types.ModuleType("rl_msprobe_live_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction", "reset_peak_memory_stats"):
        setattr(module, name, _noop)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, _zero)
    module.mem_get_info = _mem_get_info
    module.manual_seed = module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    module.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    module.get_device_name = lambda *_a, **_k: "cpu"
    module.current_device = lambda: "cpu"
    return module


_DEVICE = _device_module()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: device "cpu", gloo, Ray's fake "GPU" resource, no IPC."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # verl moves modules and batches with `.to(get_device_id())`

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # Ray's `num_gpus` is declared in ray_init; bundles ask {"CPU": n, "GPU": 1}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _worker_modules() -> list[types.ModuleType]:
    names = [n.strip() for n in os.environ.get(WORKER_MODULES_VAR, "").split(",") if n.strip()]
    return [importlib.import_module(name) for name in names]


def _patch_distributed(module: types.ModuleType) -> None:
    original = module.initialize_global_process_group_ray

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    module.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_vllm_extension(module: types.ModuleType) -> None:
    cls = module.vLLMColocateWorkerExtension
    original = cls.update_weights_from_ipc

    @functools.wraps(original)
    def update_weights_from_ipc(self, *args, **kwargs):
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        for hook_module in _worker_modules():
            hook = getattr(hook_module, "before_weight_sync", None)
            if hook is not None:
                hook(self)
        initialize_layerwise_reload(model)
        result = update_weights_from_ipc.__wrapped__(self, *args, **kwargs)  # verl's (a test may swap it)
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        for hook_module in _worker_modules():
            hook = getattr(hook_module, "after_weight_sync", None)
            if hook is not None:
                hook(self)
        return result

    cls.update_weights_from_ipc = update_weights_from_ipc


def _patch_sglang_reductions(module: types.ModuleType) -> None:
    original = module._reduce_tensor_modified

    @functools.wraps(original)
    def _reduce_tensor_modified(tensor, *args, **kwargs):
        if tensor.is_cuda:
            return original(tensor, *args, **kwargs)
        from torch.multiprocessing import reductions

        return reductions._reduce_tensor_original(tensor, *args, **kwargs)

    module._reduce_tensor_modified = _reduce_tensor_modified
    torch.multiprocessing.set_sharing_strategy("file_system")  # storages are pickled after this returns


_PATCHES = {
    "verl.utils.distributed": _patch_distributed,
    "verl.workers.rollout.vllm_rollout.utils": _patch_vllm_extension,
    "sglang.srt.utils.patch_torch": _patch_sglang_reductions,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module executes, in whichever process imports it."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(mod, _exec=exec_module, _name=name):
                    _exec(mod)
                    _PATCHES[_name](mod)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


for _name, _patch in _PATCHES.items():
    if _name in sys.modules:
        _patch(sys.modules[_name])
if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchAfterImport())
_worker_modules()

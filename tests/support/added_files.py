"""rl-msprobe's own files that patch sets add to upstream trees, loaded as modules from this checkout.

They depend on neither the upstream package nor rl-msprobe, so tests and benchmarks can run them
directly (e.g. the verl-triage line writer) without patching a tree first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

FILES = Path(__file__).resolve().parents[2] / "rl_msprobe" / "patches" / "files"


def load(relative: str, name: str) -> ModuleType:
    """`relative` under rl_msprobe/patches/files (e.g. "verl/verl/utils/rl_msprobe_triage.py"), as module `name`."""
    spec = importlib.util.spec_from_file_location(name, FILES / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

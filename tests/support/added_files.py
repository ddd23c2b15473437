"""rl-msprobe's own files that patch sets add to upstream trees, loaded as modules from this checkout.

They depend on neither the upstream package nor rl-msprobe, so tests and benchmarks can run them
directly (e.g. the verl-triage line writer) without patching a tree first.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FILES = Path(__file__).resolve().parents[2] / "rl_msprobe" / "patches" / "files"


def load(relative: str, name: str) -> ModuleType:
    """`relative` under rl_msprobe/patches/files (e.g. "verl/verl/utils/rl_msprobe_triage.py"), as module `name`."""
    spec = importlib.util.spec_from_file_location(name, FILES / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_with_records(relative: str, name: str, package: str, monkeypatch) -> ModuleType:
    """An engine helper (`relative`, as module `name`) that imports the shared recorder from its own
    tree's PACKAGE (e.g. "vllm.v1.worker"): stand-in packages down to PACKAGE, whose
    `rl_msprobe_records` is common/rl_msprobe_records.py, as in a patched tree (MONKEYPATCH undoes
    them)."""
    records = load("common/rl_msprobe_records.py", f"rl_msprobe_records_for_{name}")
    parts = package.split(".")
    for depth in range(1, len(parts) + 1):
        dotted = ".".join(parts[:depth])
        monkeypatch.setitem(sys.modules, dotted, ModuleType(dotted))
    sys.modules[package].rl_msprobe_records = records  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"{package}.rl_msprobe_records", records)
    return load(relative, name)

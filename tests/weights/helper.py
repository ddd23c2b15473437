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

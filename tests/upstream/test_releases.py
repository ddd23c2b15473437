"""The release cache under concurrent fetches (rl_msprobe/upstream/release_cache.py): two rl-msprobe
commands at once, or a test session and another, fetch one release once, and neither sees a
half-written archive or tree. A real release from the package index, into a fresh cache (~3 s)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rl_msprobe.errors import UserError
from rl_msprobe.upstream import release_cache

pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parents[2]
PROJECT, VERSION = "verl", "0.6.0"  # a small wheel (1 MB)
FETCH = """
import sys
from pathlib import Path
from rl_msprobe.upstream import release_cache

download = release_cache._pip_download

def counted(*args, **kwargs):  # one line per pip run, to count the downloads
    with open(sys.argv[1], "a") as log:
        log.write("pip\\n")
    return download(*args, **kwargs)

release_cache._pip_download = counted
root = release_cache.fetch_release(sys.argv[2], sys.argv[3])
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real wheel of the release, fetched once from the package index into a cache of its own."""
    cache = tmp_path_factory.mktemp("seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RL_MSPROBE_CACHE", str(cache))
        release_cache.fetch_release(PROJECT, VERSION)
    (archive,) = (cache / "downloads").iterdir()
    return archive


def _cache_with(
    tmp_path: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch, damage
) -> tuple[Path, list[str]]:
    """A cache whose downloads/ holds the wheel as DAMAGE(bytes) left it (no release unpacked yet);
    pip's runs are counted."""
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / wheel.name).write_bytes(damage(wheel.read_bytes()))
    monkeypatch.setenv("RL_MSPROBE_CACHE", str(cache))
    runs: list[str] = []
    download = release_cache._pip_download

    def counted(*args, **kwargs):
        runs.append("pip")
        return download(*args, **kwargs)

    monkeypatch.setattr(release_cache, "_pip_download", counted)
    return cache, runs


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:-100],
        lambda b: b"",
        _flip,
        lambda b: b"<html>proxy error</html>",
    ],
    ids=["half", "end cut", "empty", "one byte flipped", "not a zip"],
)
def test_a_damaged_cached_wheel_is_fetched_again(tmp_path, wheel, monkeypatch, damage) -> None:
    """A wheel cut short in downloads/ (a killed pip, a full disk) used to be a BadZipFile on every
    run after; it is tested before use and fetched again."""
    cache, runs = _cache_with(tmp_path, wheel, monkeypatch, damage)
    root = release_cache.fetch_release(PROJECT, VERSION)
    assert (root / "verl" / "__init__.py").is_file() and runs == ["pip"]
    archive = cache / "downloads" / wheel.name
    assert archive.read_bytes() == wheel.read_bytes()  # whole again
    assert release_cache.fetch_release(PROJECT, VERSION) == root and runs == ["pip"]  # and used from then on


def test_a_whole_cached_wheel_is_not_fetched_again(tmp_path, wheel, monkeypatch) -> None:
    cache, runs = _cache_with(tmp_path, wheel, monkeypatch, lambda b: b)
    assert (release_cache.fetch_release(PROJECT, VERSION) / "verl" / "__init__.py").is_file() and runs == []


def test_a_damaged_fresh_download_is_refused_and_not_kept(tmp_path, wheel, monkeypatch) -> None:
    """The index (or a proxy) sends a wheel cut short: exit 2 naming it, nothing kept to fail again."""
    cache, _ = _cache_with(tmp_path, wheel, monkeypatch, lambda b: b)
    (cache / "downloads" / wheel.name).unlink()

    def short(argv, cwd, env=None):
        target = Path(argv[argv.index("-d") + 1])
        (target / wheel.name).write_bytes(wheel.read_bytes()[:5000])
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(release_cache, "_pip_download", short)
    with pytest.raises(UserError, match=rf"{PROJECT}=={VERSION}: the archive .*{wheel.name}\) is damaged"):
        release_cache.fetch_release(PROJECT, VERSION)
    assert list((cache / "downloads").iterdir()) == []
    assert not (cache / "releases" / f"{PROJECT}-{VERSION}").exists()


def test_folders_a_killed_fetch_left_are_removed_unless_their_fetch_runs(
    tmp_path, wheel, monkeypatch
) -> None:
    cache, _ = _cache_with(tmp_path, wheel, monkeypatch, lambda b: b)
    downloads, rels = cache / "downloads", cache / "releases"
    rels.mkdir()
    mine = [downloads / f".{PROJECT}-{VERSION}-pip-ab12cd34", rels / f".{PROJECT}-{VERSION}-x9y8z7w6"]
    other_idle = [downloads / ".sglang-0.5.12-pip-qwertyui", rels / ".sglang-0.5.12-asdfghjk"]
    other_running = [downloads / ".verl-0.9.1-pip-zxcvbnm1", rels / ".verl-0.9.1-poiuytre"]
    for folder in mine + other_idle + other_running:
        (folder / "downloads").mkdir(parents=True)
        (folder / "downloads" / "part.whl").write_bytes(b"PK\x03\x04 cut")
    lock = os.open(rels / ".verl-0.9.1.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a fetch of verl 0.9.1 is running
        assert (release_cache.fetch_release(PROJECT, VERSION) / "verl" / "__init__.py").is_file()
    finally:
        os.close(lock)
    assert not any(p.exists() for p in mine + other_idle)
    assert all(p.exists() for p in other_running)
    assert (downloads / wheel.name).is_file() and (rels / f".{PROJECT}-{VERSION}.lock").is_file()

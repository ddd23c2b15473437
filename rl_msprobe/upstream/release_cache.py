"""Releases fetched from the package index into the user cache (`release:verl==0.9.1`, read-only).

Only the package folder and its version metadata are kept: rl-msprobe reads and patches Python
sources, never runs them, so nothing is built. Fetches of one release are serialised across
processes by a lock file beside it (two commands at once, or a test session and its background
prefetch): the second waits and finds the release in place. Nothing is half-written: pip downloads
into a private folder whose archive is moved into the shared `downloads/` whole, and the release
folder appears by one rename. The cache heals itself: an archive in `downloads/` is tested (zip
CRCs, the gzip stream) before it is unpacked and fetched again when damaged, and the folders a
killed fetch left are removed by the next fetch (while no fetch of their release runs).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_msprobe.errors import UserError
from rl_msprobe.upstream.projects import packages

RELEASE_PREFIX = "release:"


def cache_dir() -> Path:
    """The user cache for fetched releases (override with RL_MSPROBE_CACHE)."""
    base = os.environ.get("RL_MSPROBE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl-msprobe"
    )
    return Path(base)


def release_dir(project: str, version: str) -> Path:
    """Where `fetch_release` keeps `project==version` (it may not be there yet)."""
    return cache_dir() / "releases" / f"{project}-{version}"


def parse_release_spec(spec: str) -> tuple[str, str]:
    body = spec[len(RELEASE_PREFIX) :] if spec.startswith(RELEASE_PREFIX) else spec
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", body.strip())
    if not match:
        raise UserError(f"{spec!r}: write a release as release:NAME==VERSION, e.g. release:verl==0.9.1.")
    name = match.group(1).lower().replace("_", "-")
    if name not in packages():
        raise UserError(f"{spec!r}: unknown project {name!r}; known: {', '.join(packages())}.")
    return name, match.group(2)


def _pip_download(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
        env={**os.environ, **env} if env else None,
    )


def _sdist_source_tree(spec: str, package: str, downloads: Path, work: Path) -> tuple[Path | None, str]:
    """The unpacked source of an sdist whose build cannot run here (vLLM-Ascend needs CANN).

    pip unpacks the sdist into TMPDIR/pip-download-*/ before it prepares the metadata; that
    step fails without the build toolchain, but with --no-clean the unpacked tree stays. Nothing
    is built. Returns (folder holding the package, pip's stderr).
    """
    proc = _pip_download(
        ["--no-binary", ":all:", "--no-build-isolation", "--no-clean", "-d", str(downloads), spec],
        downloads,
        env={"TMPDIR": str(work)},
    )
    for init in sorted(work.glob(f"pip-download-*/*/{package}/__init__.py")):
        return init.parent.parent, proc.stderr
    return None, proc.stderr


def _extract_wheel(wheel: Path, dest: Path, package: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(f"{package}/") or ".dist-info/" in m]
        zf.extractall(dest, members)


def _extract_sdist(archive: Path, dest: Path, package: str) -> None:
    import tarfile

    with tarfile.open(archive) as tf:
        top_members = tf.getmembers()
        prefix = top_members[0].name.split("/")[0]
        for member in top_members:
            rel = member.name[len(prefix) + 1 :]
            if not rel or not (rel.startswith(f"{package}/") or rel == "PKG-INFO"):
                continue
            if not (member.isfile() or member.isdir()):
                continue
            member.name = rel
            tf.extract(member, dest, filter="data")


# Projects whose wheels are large platform builds (vLLM: hundreds of MB of compiled kernels)
# while rl-msprobe reads only their Python sources: take the sdist's unpacked tree instead.
SOURCE_FROM_SDIST = frozenset({"vllm"})


def fetch_release(project: str, version: str) -> Path:
    """Download `project==version` once into the cache and return the folder holding the package.

    Wheels are unpacked; a project that ships only sdists is unpacked from the sdist
    without building it. The result is cached in `cache_dir()/releases/NAME-VERSION/`.
    """
    package = packages()[project]
    dest = release_dir(project, version)
    _clean_stale(cache_dir() / "downloads", dest.parent)
    if (dest / package / "__init__.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _fetch_lock(dest):
        if not (dest / package / "__init__.py").is_file():  # or another process fetched it meanwhile
            _fetch_locked(project, version, package, dest)
    return dest


@contextmanager
def _fetch_lock(dest: Path) -> Iterator[None]:
    """Hold `.NAME-VERSION.lock` beside the release while fetching it (waits for another fetch).

    The file stays (removing a lock file lets a waiting process lock a file no longer there).
    """
    lock = dest.parent / f".{dest.name}.lock"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock, flags, 0o644)
    except OSError as exc:
        why = (
            "is a symlink (rl-msprobe never opens its lock through a link)"
            if exc.errno == errno.ELOOP
            else exc.strerror
        )
        raise UserError(
            f"{lock}: cannot hold the release cache's lock: {why}. Remove it and run again."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _current["release"] = dest.name
        yield
    finally:
        _current.pop("release", None)
        os.close(fd)  # releases the lock


def _fetch_locked(project: str, version: str, package: str, dest: Path) -> None:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{project}=={version}"
    archive = _find_download(downloads, project, version)
    if archive is not None and _damaged(archive):
        archive.unlink()  # cut short or corrupted: fetched again below
        archive = None
    # pip writes into a private folder; a finished archive is then renamed into `downloads/`
    work = Path(tempfile.mkdtemp(prefix=f".{project}-{version}-pip-", dir=downloads))
    private = work / "downloads"
    private.mkdir()
    try:
        source = None
        if archive is None and project not in SOURCE_FROM_SDIST:
            _pip_download(
                ["--only-binary", ":all:", "--python-version", "3.11", "-d", str(private), spec], private
            )
            archive = _keep(_find_download(private, project, version), downloads)
        if archive is None:
            source, stderr = _sdist_source_tree(spec, package, private, work)
            archive = _keep(_find_download(private, project, version), downloads)
            if archive is None and source is None:
                raise UserError(f"could not fetch {spec} from the package index: {stderr.strip()[-400:]}")
        if archive is not None and _damaged(archive):
            archive.unlink()
            raise UserError(
                f"{spec}: the archive the package index sent ({archive.name}) is damaged ({_damaged(archive)}"
                "); run again (it is fetched anew), or check the index or proxy PIP_INDEX_URL names."
            )
        _unpack_release(archive, source, dest, package)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _damaged(archive: Path) -> str | None:
    """Why a downloaded wheel or sdist cannot be unpacked (None: whole). Every member's CRC for a
    zip (a wheel), the whole gzip stream (its CRC and length are at the end) for a tar.gz: a
    download cut short, or damaged on disk, is caught before it is used, not on every run after."""
    import gzip
    import zlib

    try:
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as zf:
                bad = zf.testzip()
            return None if bad is None else f"member {bad} fails its CRC"
        with gzip.open(archive) as stream:
            while stream.read(1 << 20):
                pass
        return None
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
        return f"{type(exc).__name__}: {exc}"


# what a killed fetch leaves: pip's private folder in downloads/, a half-unpacked folder beside
# the release (tempfile.mkdtemp's names: the prefix, then 8 characters)
_STALE = (
    ("downloads", re.compile(r"^\.(?P<release>.+)-pip-[a-z0-9_]{8}$")),
    ("releases", re.compile(r"^\.(?P<release>.+)-[a-z0-9_]{8}$")),
)


def _clean_stale(downloads: Path, releases: Path) -> None:
    """Remove the folders killed fetches left (pip's private downloads, half-unpacked releases),
    each only while its release's lock is free (no fetch of it is running): the caller holds its
    own release's lock, which is taken again here without waiting (flock is per descriptor)."""
    for folder, pattern in ((downloads, _STALE[0][1]), (releases, _STALE[1][1])):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            match = pattern.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            lock = releases / f".{match.group('release')}.lock"
            if _lock_is_free(lock, held=releases / f".{_current.get('release')}.lock"):
                shutil.rmtree(entry.path, ignore_errors=True)


_current: dict[str, str] = {}  # the release whose lock this process holds while fetching


def _lock_is_free(lock: Path, held: Path) -> bool:
    if lock == held:
        return True  # ours: nothing else is fetching this release
    try:
        fd = os.open(lock, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True  # never locked: no fetch of that release has run here
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _keep(download: Path | None, downloads: Path) -> Path | None:
    """Move a finished download into the shared folder in one rename (None stays None)."""
    if download is None:
        return None
    kept = downloads / download.name
    os.replace(download, kept)
    return kept


def _unpack_release(archive: Path | None, source: Path | None, dest: Path, package: str) -> None:
    """Put the package folder (and the version metadata) of a download into `dest`, atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        if archive is not None and archive.suffix == ".whl":
            _extract_wheel(archive, tmp, package)
        elif archive is not None:
            _extract_sdist(archive, tmp, package)
        elif source is not None:
            shutil.copytree(source / package, tmp / package, symlinks=True)
            if (source / "PKG-INFO").is_file():
                shutil.copy2(source / "PKG-INFO", tmp / "PKG-INFO")
        if not (tmp / package / "__init__.py").is_file():
            raise UserError(f"{archive.name if archive else source}: holds no {package}/__init__.py.")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _find_download(folder: Path, project: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", project).lower()
    for path in sorted(folder.iterdir()):
        name = path.name.lower().replace("-", "_")
        if not name.startswith(f"{stem}_{version.lower()}"):
            continue
        rest = name[len(stem) + 1 + len(version) :]
        if rest.startswith(("_", ".tar", ".zip")) and path.suffix in (".whl", ".gz", ".zip"):
            return path
    return None

"""Upstream trees that rl-msprobe reads or patches, and how to find their version.

A target is the directory that holds an upstream package (`verl/`, `sglang/`, `vllm/`,
`vllm_ascend/`): a git checkout, an editable install, site-packages, or a release
fetched from the package index into a user cache (`release:verl==0.9.1`, read-only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rl_msprobe.errors import UserError

RELEASE_PREFIX = "release:"

# project name -> import package folder
PACKAGES: dict[str, str] = {
    "verl": "verl",
    "sglang": "sglang",
    "vllm": "vllm",
    "vllm-ascend": "vllm_ascend",
}


@dataclass(frozen=True)
class Target:
    """One upstream tree: where it is, what it is, and whether rl-msprobe may write it."""

    project: str
    version: str | None
    root: Path  # the folder that holds the package folder
    readonly: bool = False
    origin: str = ""  # how the user named it (path, --python command, release spec)

    @property
    def package_dir(self) -> Path:
        return self.root / PACKAGES[self.project]

    def describe(self) -> str:
        return f"{self.project} {self.version or '(unknown version)'} at {self.root}"


def cache_dir() -> Path:
    """The user cache for fetched releases (override with RL_MSPROBE_CACHE)."""
    base = os.environ.get("RL_MSPROBE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl-msprobe"
    )
    return Path(base)


# ---------------------------------------------------------------- version detection


# `__version__ = "1.2"`, `version: str = "1.2"`, and setuptools-scm's `__version__ = version = '1.2'`
_VERSION_ASSIGN = re.compile(
    r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M
)


def _dist_info_version(root: Path, project: str) -> str | None:
    wanted = re.sub(r"[-_.]+", "_", project).lower()
    for meta in sorted(root.glob("*.dist-info/METADATA")):
        name = meta.parent.name[: -len(".dist-info")].rsplit("-", 1)
        if len(name) == 2 and re.sub(r"[-_.]+", "_", name[0]).lower() == wanted:
            return name[1]
    return None


def _pkg_info_version(root: Path) -> str | None:
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        match = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.M)
        if match:
            return match.group(1)
    return None


def detect_version(root: Path, project: str) -> str | None:
    """Read the version from the tree itself, never by importing the package."""
    package = root / PACKAGES[project]
    candidates = [package / "version" / "version"]  # verl
    for candidate in candidates:
        if candidate.is_file():
            text = candidate.read_text().strip()
            if text:
                return text
    for name in ("version.py", "_version.py"):
        path = package / name
        if path.is_file():
            match = _VERSION_ASSIGN.search(path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return _dist_info_version(root, project) or _pkg_info_version(root)


def detect_project(root: Path) -> str | None:
    """Which known upstream package this folder holds (None when none)."""
    for project, package in PACKAGES.items():
        if (root / package / "__init__.py").is_file():
            return project
    return None


# ---------------------------------------------------------------- resolving user input


def _normalize_root(path: Path, project: str | None) -> tuple[Path, str]:
    """Accept the folder holding the package or the package folder itself."""
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"{path}: no such folder. Pass --tree the folder that holds the upstream package.")
    found = detect_project(path)
    if found is None and path.name in PACKAGES.values() and (path / "__init__.py").is_file():
        path = path.parent
        found = detect_project(path)
    if project is not None:
        if not (path / PACKAGES[project] / "__init__.py").is_file():
            raise UserError(
                f"{path}: no {PACKAGES[project]}/__init__.py here, so this is not a {project} tree. "
                f"Pass --tree the folder that holds {PACKAGES[project]}/ (or that package folder itself)."
            )
        return path, project
    if found is None:
        raise UserError(
            f"{path}: holds none of {', '.join(p + '/' for p in PACKAGES.values())}. "
            "Pass --tree the folder that holds the upstream package."
        )
    return path, found


def resolve_tree(spec: str, project: str | None = None) -> Target:
    """A --tree value: a path, or `release:NAME==VERSION` (fetched, read-only)."""
    if spec.startswith(RELEASE_PREFIX):
        name, version = parse_release_spec(spec)
        if project is not None and name != project:
            raise UserError(f"--tree {spec}: this patch set is for {project}, not {name}.")
        root = fetch_release(name, version)
        return Target(name, detect_version(root, name) or version, root, readonly=True, origin=spec)
    root, found = _normalize_root(Path(spec), project)
    return Target(found, detect_version(root, found), root, origin=spec)


_FIND_SPEC = (
    "import importlib.util, json, sys\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        spec = importlib.util.find_spec(name)\n"
    "    except Exception:\n"
    "        spec = None\n"
    "    locs = list(spec.submodule_search_locations or []) if spec else []\n"
    "    out[name] = locs[0] if locs else None\n"
    "print(json.dumps(out))\n"
)


def locate_with_python(python: str, packages: list[str]) -> dict[str, str | None]:
    """Ask an interpreter (maybe `docker exec -i NAME python3`) where packages live, without importing them."""
    from rl_msprobe.env import python_argv

    argv = python_argv(python)
    try:
        proc = subprocess.run(
            [*argv, "-c", _FIND_SPEC, *packages], capture_output=True, text=True, timeout=120, check=False
        )
    except FileNotFoundError as exc:
        raise UserError(
            f"--python {python}: {exc.filename} was not found. Pass a working interpreter."
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"--python {python}: no answer within 120 s.") from exc
    except OSError as exc:
        raise UserError(
            f"--python {python}: cannot be run ({exc.strerror}). Pass a working interpreter."
        ) from exc
    if proc.returncode != 0:
        raise UserError(f"--python {python} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise UserError(f"--python {python}: unexpected output {proc.stdout[-200:]!r}.") from exc


def resolve_python(python: str, project: str) -> Target:
    """A --python value: the tree that interpreter would import `project` from."""
    package = PACKAGES[project]
    location = locate_with_python(python, [package])[package]
    if location is None:
        raise UserError(
            f"--python {python}: that interpreter cannot find the {package} package. Install it there."
        )
    package_dir = Path(location)
    if not package_dir.is_dir():
        raise UserError(
            f"--python {python}: {package} lives at {package_dir} in that interpreter, which this machine "
            "cannot see (a container?). Run rl-msprobe where that folder is visible, or pass --tree."
        )
    root = package_dir.parent
    return Target(project, detect_version(root, project), root, origin=f"--python {python}")


def resolve_target(
    tree: str | None, python: str | None, project: str, default_version: str | None = None
) -> Target:
    """Turn --tree / --python (or neither: the newest supported release) into a Target."""
    if tree and python:
        raise UserError("Pass either --tree or --python, not both.")
    if tree:
        return resolve_tree(tree, project)
    if python:
        return resolve_python(python, project)
    if default_version is None:
        raise UserError(f"Pass --tree PATH or --python PY to say which {project} tree to use.")
    return resolve_tree(f"{RELEASE_PREFIX}{project}=={default_version}", project)


# ---------------------------------------------------------------- releases from the index


def parse_release_spec(spec: str) -> tuple[str, str]:
    body = spec[len(RELEASE_PREFIX) :] if spec.startswith(RELEASE_PREFIX) else spec
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", body.strip())
    if not match:
        raise UserError(f"{spec!r}: write a release as release:NAME==VERSION, e.g. release:verl==0.9.1.")
    name = match.group(1).lower().replace("_", "-")
    if name not in PACKAGES:
        raise UserError(f"{spec!r}: unknown project {name!r}; known: {', '.join(PACKAGES)}.")
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
    package = PACKAGES[project]
    dest = cache_dir() / "releases" / f"{project}-{version}"
    if (dest / package / "__init__.py").is_file():
        return dest
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{project}=={version}"
    archive = _find_download(downloads, project, version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{project}-{version}-pip-", dir=dest.parent))
    try:
        source = None
        if archive is None and project not in SOURCE_FROM_SDIST:
            _pip_download(
                ["--only-binary", ":all:", "--python-version", "3.11", "-d", str(downloads), spec], downloads
            )
            archive = _find_download(downloads, project, version)
        if archive is None:
            source, stderr = _sdist_source_tree(spec, package, downloads, work)
            archive = _find_download(downloads, project, version)
            if archive is None and source is None:
                raise UserError(f"could not fetch {spec} from the package index: {stderr.strip()[-400:]}")
        _unpack_release(archive, source, dest, package)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


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

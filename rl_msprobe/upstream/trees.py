"""Upstream trees that rl-msprobe reads or patches, and how to find their version.

A target is the directory that holds an upstream package (`verl/`, `sglang/`, `vllm/`,
`vllm_ascend/`): a git checkout, an editable install, site-packages, or a release
fetched from the package index into a user cache (`release:verl==0.9.1`, read-only;
`upstream.release_cache`). A tree is found from a path, or through an interpreter (`--python`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rl_msprobe import bounded
from rl_msprobe.errors import UserError
from rl_msprobe.upstream.interpreter import locate_with_python
from rl_msprobe.upstream.projects import packages
from rl_msprobe.upstream.release_cache import RELEASE_PREFIX, fetch_release, parse_release_spec

# project name -> import package folder (the table in `upstream.projects`)
PACKAGES: dict[str, str] = packages()


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
        text = bounded.read_bytes(pkg_info, "PKG-INFO", bounded.CONFIG).decode("utf-8", "replace")
        match = re.search(r"^Version:\s*(\S+)", text, re.M)
        if match:
            return match.group(1)
    return None


def detect_version(root: Path, project: str) -> str | None:
    """Read the version from the tree itself, never by importing the package."""
    package = root / PACKAGES[project]
    candidates = [package / "version" / "version"]  # verl
    for candidate in candidates:
        if candidate.is_file():
            try:
                text = bounded.read_bytes(candidate, "version file", bounded.CONFIG).decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{candidate}: not UTF-8 text (byte {exc.start}); verl writes its version there as plain "
                    "text. Restore that file from the release (or remove it) and run again."
                ) from None
            if text:
                return text
    for name in ("version.py", "_version.py"):
        path = package / name
        if path.is_file():
            match = _VERSION_ASSIGN.search(
                bounded.read_bytes(path, "version file", bounded.CONFIG).decode("utf-8", "replace")
            )
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

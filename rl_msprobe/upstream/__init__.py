"""Upstream projects (verl, SGLang, vLLM, vLLM-Ascend): one table of facts, their trees, their releases.

- `projects`: the table (package folder, newest tested release, what is assumed when unknown).
- `trees`: a `Target` from a path, `release:NAME==VER` or `--python PY`; versions read from files.
- `release_cache`: releases fetched from the package index into the user cache.
- `interpreter`: another Python interpreter's argv and where it imports packages from.
"""

from __future__ import annotations

from rl_msprobe.upstream.projects import PROJECTS, Project, packages, project
from rl_msprobe.upstream.release_cache import RELEASE_PREFIX, cache_dir, fetch_release, parse_release_spec
from rl_msprobe.upstream.trees import (
    Target,
    detect_project,
    detect_version,
    resolve_python,
    resolve_target,
    resolve_tree,
)

__all__ = [
    "PROJECTS",
    "RELEASE_PREFIX",
    "Project",
    "Target",
    "cache_dir",
    "detect_project",
    "detect_version",
    "fetch_release",
    "packages",
    "parse_release_spec",
    "project",
    "resolve_python",
    "resolve_target",
    "resolve_tree",
]

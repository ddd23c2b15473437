"""The environment of rl-msprobe's own git commands: always the tree's repository.

A shell may export `GIT_DIR`, `GIT_WORK_TREE`, `GIT_INDEX_FILE`, `GIT_OBJECT_DIRECTORY`... (scripts,
dotfile setups, a git hook that runs rl-msprobe). git would then work in the repository they name,
not in the tree's. rl-msprobe finds the repository from the tree itself and runs every git command
there with these variables removed (`env`), and says so in the result's notes (`ignored`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# where git finds the repository, its index, objects and refs (`git rev-parse --local-env-vars`,
# less the config ones, plus the namespace and discovery ones): none of them may send a command elsewhere
LOCATION = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_COMMON_DIR",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_IMPLICIT_WORK_TREE",
    "GIT_NAMESPACE",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
    "GIT_GRAFT_FILE",
    "GIT_SHALLOW_FILE",
    "GIT_NO_REPLACE_OBJECTS",
    "GIT_REPLACE_REF_BASE",
    "GIT_PREFIX",
    "GIT_INTERNAL_SUPER_PREFIX",
    "GIT_QUARANTINE_PATH",
)

_CONSTRUCTING = threading.Lock()


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the repository-location variables, plus `extra`
    (rl-msprobe's own temporary index, an identity)."""
    out = {k: v for k, v in os.environ.items() if k not in LOCATION}
    out.update(extra or {})
    return out


def ignored() -> list[str]:
    """The location variables set in this process's environment (each ignored by rl-msprobe's git)."""
    return [name for name in LOCATION if name in os.environ]


def note(work_tree: str) -> str | None:
    """The result's note when the environment names a repository location: it was not used."""
    names = ignored()
    if not names:
        return None
    shown = ", ".join(f"{n}={os.environ[n]}" for n in names)
    return (
        f"{shown} in the environment: ignored; rl-msprobe's git commands work in the tree's own repository "
        f"{work_tree}."
    )


@contextmanager
def without_location() -> Iterator[None]:
    """GitPython reads GIT_WORK_TREE, GIT_COMMON_DIR and GIT_OBJECT_DIRECTORY from os.environ while it
    opens a repository: they are out of it for that moment (one opening at a time), then put back."""
    with _CONSTRUCTING:
        saved = {name: os.environ.pop(name) for name in ignored()}
        try:
            yield
        finally:
            os.environ.update(saved)

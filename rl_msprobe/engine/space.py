"""Room on disk, checked before the first byte: the files, their journal copies (and outside git the
saved originals), and on git the objects of the commit. A full disk then refuses with the figure
instead of failing half-way (and a git that cannot write its objects cannot commit)."""

from __future__ import annotations

import os
from pathlib import Path

from rl_msprobe.bounded import size_text
from rl_msprobe.engine.plan_parts import FileChange
from rl_msprobe.engine.tree import Tree
from rl_msprobe.errors import UserError

MARGIN = 1 << 20  # per file system: the journal's json, git's tree objects, the temporary files' metadata


def free_bytes(path: Path) -> int:
    """Bytes this user may still write on the file system holding `path` (its nearest existing folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def _device(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.stat().st_dev


def needed(tree: Tree, changes: list[FileChange]) -> dict[Path, int]:
    """Folder -> bytes the operation writes there."""
    after = sum(len(c.after or b"") for c in changes)
    before = sum(len(c.before or b"") for c in changes)
    out = {tree.root: after, tree.state: before + after + (0 if tree.repo is not None else before)}
    if tree.repo is not None:
        out[Path(tree.repo.git_dir) / "objects"] = after  # loose objects: compressed, at most this
    return out


def require(tree: Tree, changes: list[FileChange]) -> None:
    """Refuse (exit 2, nothing written) when a file system has not the room the operation needs."""
    by_device: dict[int, tuple[Path, int]] = {}
    for folder, size in needed(tree, changes).items():
        device = _device(folder)
        first, total = by_device.get(device, (folder, 0))
        by_device[device] = (first, total + size)
    for folder, total in by_device.values():
        want = total + MARGIN
        free = free_bytes(folder)
        if free < want:
            raise UserError(
                f"{folder}: {size_text(free)} free, rl-msprobe needs about {size_text(want)} there (the patched "
                "files, their copies in its journal and git's objects); free some space and run again. "
                "Nothing was changed."
            )

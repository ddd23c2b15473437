"""No user byte lost: a helper file rl-msprobe added and the user edited since is never replaced or
deleted without a word, and nothing is written through a link that leaves a plain tree.

rl-msprobe's own bytes are known by what it recorded when it wrote them: outside git the manifest's
hash of what it wrote (so a helper of an older rl-msprobe is still replaced), on git the last commit
that touched the file (an rl-msprobe commit: its bytes; any other: an edit the user committed).
"""

from __future__ import annotations

from pathlib import Path

from rl_msprobe.engine import git, journal, manifest
from rl_msprobe.engine.plan import unique_pieces
from rl_msprobe.engine.plan_parts import FileChange, Plan
from rl_msprobe.engine.tree import Tree
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile

_OURS = "rl-msprobe: "  # the subject of every commit rl-msprobe makes (git.message)


def check_helpers(tree: Tree, plan: Plan, verb: str) -> None:
    """Refuse (nothing written) when `plan` would replace or delete a helper file that differs both from
    the helper this rl-msprobe adds and from what rl-msprobe wrote there."""
    added = {
        piece.path: piece.item for _, piece in unique_pieces(plan.sets) if isinstance(piece.item, NewFile)
    }
    written = None if tree.repo is not None else manifest.load_manifest(tree.state).get("files", {})
    for change in plan.changes:
        item = added.get(change.path)
        if item is None or change.before is None or change.before == item.content():
            continue
        if written is not None:
            entry = written.get(change.path)
            if isinstance(entry, dict) and entry.get("applied_sha256") == journal.sha(change.before):
                continue
        elif _last_commit_is_ours(tree, plan.target.root, change):
            continue
        path = plan.target.root / change.path
        if verb == "revert":
            raise UserError(
                f"{path}: rl-msprobe's helper, edited since rl-msprobe wrote it; the revert would delete your "
                "edits. Move your copy out of the tree (the revert then leaves the file alone), then revert "
                "again. Nothing was changed."
            )
        raise UserError(
            f"{path}: rl-msprobe's helper, edited since rl-msprobe wrote it; apply would replace your edits. "
            "Move your copy out of the tree (or restore rl-msprobe's: revert first), then apply again. Nothing "
            "was changed."
        )


def _last_commit_is_ours(tree: Tree, root: Path, change: FileChange) -> bool:
    assert tree.repo is not None  # a git tree
    rel = git.repo_paths(tree.repo, root, [change])[0]
    subject = git.run(tree.repo, "log", "-1", "--format=%s", "HEAD", "--", rel).stdout.strip()
    return subject.startswith(_OURS)


def check_links(root: Path, changes: list[FileChange]) -> None:
    """Outside git: refuse a file (or a folder on its way) that is a link leading out of the tree; git
    trees refuse the same in `git.repo_paths`."""
    top = root.resolve()
    for change in changes:
        real = (root / change.path).resolve()
        if real != top and top not in real.parents:
            raise UserError(
                f"{root / change.path}: a symlink to {real}, outside the tree {top}; rl-msprobe would write "
                "there. Replace the link by the file, or patch the tree it points into. Nothing was changed."
            )

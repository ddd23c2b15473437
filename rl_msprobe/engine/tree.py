"""How one tree is written: through git (branch + commit) or as files plus a manifest, and where its
lock, journal and manifest live."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rl_msprobe.engine import git, gitenv, journal
from rl_msprobe.errors import UserError
from rl_msprobe.upstream.trees import Target

if TYPE_CHECKING:
    from git import Repo  # GitPython, imported at run time only where a tree is opened


@dataclass
class Tree:
    """How a tree is written: its git repo (None: files + manifest), its state folder, and why."""

    repo: Repo | None
    state: Path
    root: Path  # the folder holding the package: journal paths are relative to it
    notes: list[str] = field(default_factory=list)


def open_tree(target: Target, writing: bool) -> Tree:
    repo = git.open_repo(target.root)
    notes = []
    if repo is not None and repo.working_tree_dir is not None and git.ignored_by(repo, target):
        notes.append(
            f"{target.package_dir} is ignored by the git repository at {repo.working_tree_dir} (.gitignore): "
            "patched without git, originals kept beside it for an exact revert."
        )
        repo = None
    if repo is not None and repo.working_tree_dir is not None:
        ignored = gitenv.note(str(repo.working_tree_dir))
        notes += [ignored] if ignored else []
    if repo is not None and writing:
        _refuse_object_format(repo)
    if repo is not None and writing and git.head_state(repo)[1] is None:
        raise UserError(
            f"{repo.working_tree_dir}: a git repository with no commits yet; rl-msprobe commits on top of the "
            "upstream files. Commit them first (git add -A && git commit -m upstream) and run again."
        )
    state = journal.state_dir(target.root, Path(repo.git_dir) if repo is not None else None)
    return Tree(repo, state, target.root, notes)


def _refuse_object_format(repo: Repo) -> None:
    """A repository of git's SHA-256 object format is said to be one (its HEAD is no "no commits
    yet" to GitPython, and its object names are no SHA-1 to rl-msprobe's commit)."""
    found = git.run(repo, "rev-parse", "--show-object-format").stdout.strip()
    if found not in ("", "sha1"):
        raise UserError(
            f"{repo.working_tree_dir}: a git repository in the {found} object format; rl-msprobe commits in "
            "SHA-1 repositories only. Patch a SHA-1 copy of the tree (git init in a copy, then git add -A && "
            "git commit). Nothing was changed."
        )


def where(tree: Tree) -> str:
    """The tree as the user knows it: the git checkout, or the folder beside its state folder."""
    return str(tree.repo.working_tree_dir) if tree.repo is not None else str(tree.state.parent)

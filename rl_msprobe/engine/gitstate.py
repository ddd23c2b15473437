"""The git states a user may be in when rl-msprobe is asked to commit, and which of them it refuses.

- an operation in progress (rebase, am, merge, cherry-pick, revert, bisect): rl-msprobe's commit
  would land on the branch in the middle of it, so it refuses, naming it and how to finish or abort;
- uncommitted changes, shown or hidden: `git diff` does not show a file marked `assume-unchanged`
  or `skip-worktree`, so the files the commit touches are compared with the index themselves;
- git failing to read the tree (a required clean filter that fails): one line with git's own words.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rl_msprobe.engine import git
from rl_msprobe.engine.plan_parts import FileChange
from rl_msprobe.errors import UserError

if TYPE_CHECKING:
    from git import Repo  # GitPython, imported at run time only where a tree is opened

# (path in the git dir, what is in progress, how to finish or abort it); the first found is named
OPERATIONS = (
    ("rebase-merge", "a rebase", "finish it (git rebase --continue) or abort it (git rebase --abort)"),
    (
        "rebase-apply/applying",
        "a `git am`",
        "finish it (git am --continue, or --skip) or abort it (git am --abort)",
    ),
    ("rebase-apply", "a rebase", "finish it (git rebase --continue) or abort it (git rebase --abort)"),
    ("MERGE_HEAD", "a merge", "conclude it (resolve, then git commit) or abort it (git merge --abort)"),
    (
        "CHERRY_PICK_HEAD",
        "a cherry-pick",
        "finish it (git cherry-pick --continue) or abort it (git cherry-pick --abort)",
    ),
    ("REVERT_HEAD", "a revert", "finish it (git revert --continue) or abort it (git revert --abort)"),
    (
        "sequencer",
        "a cherry-pick or revert sequence",
        "finish it (git cherry-pick --continue) or abort it (git cherry-pick --abort)",
    ),
    ("BISECT_LOG", "a bisect", "end it (git bisect reset)"),
    ("BISECT_START", "a bisect", "end it (git bisect reset)"),
)


def _git_paths(repo: Repo, names: list[str]) -> list[Path]:
    """Where git keeps each state file of this work tree (a linked worktree has its own)."""
    args = [a for name in names for a in ("--git-path", name)]
    out = git.run(repo, "rev-parse", *args).stdout.splitlines()
    top = git.work_tree(repo)
    return [top / line for line in out] if len(out) == len(names) else [Path(repo.git_dir) / n for n in names]


def check_idle(repo: Repo) -> None:
    """Refuse (exit 2, nothing written) while a rebase, am, merge, cherry-pick, revert or bisect is in progress."""
    paths = _git_paths(repo, [name for name, _, _ in OPERATIONS])
    for (_, what, how), path in zip(OPERATIONS, paths):
        if path.exists():
            raise UserError(
                f"{git.work_tree(repo)}: {what} is in progress ({path} is there); rl-msprobe's commit would land "
                f"in the middle of it. {how[0].upper() + how[1:]}, then run again. Nothing was changed."
            )


def _read(repo: Repo, what: str, *args: str) -> str:
    """git ARGS, or exit 2 with git's own last lines (a failing required filter, a broken index)."""
    try:
        return git.call(repo, *args)
    except git.git_error() as exc:
        said = git.one_line(getattr(exc, "stderr", str(exc)))
        fix = (
            "free some space"
            if "space" in said.lower()
            else "fix that (a failing filter: .gitattributes and `git config filter.<name>.clean`)"
        )
        raise UserError(
            f"{git.work_tree(repo)}: git could not {what}: {said}. {fix[0].upper() + fix[1:]} and run again. "
            "Nothing was changed."
        ) from None


def dirty(repo: Repo) -> list[str]:
    """Files whose work tree differs from the index, or the index from HEAD (`git diff` shows them)."""
    shown = _read(
        repo,
        "compare the work tree with the index",
        "diff",
        "--no-ext-diff",
        "--no-renames",
        "--name-only",
        "-z",
    )
    staged = _read(
        repo,
        "compare the index with HEAD",
        "diff",
        "--cached",
        "--no-renames",
        "--name-only",
        "-z",
        "HEAD",
        "--",
    )
    return sorted({p for p in (shown + "\0" + staged).split("\0") if p})


def _flags(repo: Repo, paths: list[str]) -> dict[str, str]:
    """`paths` the index marks assume-unchanged or skip-worktree (a sparse checkout's), and which."""
    if not paths:
        return {}
    listed = _read(repo, "list the index", "ls-files", "-v", "-z", "--", *paths)
    flagged: dict[str, str] = {}
    for record in filter(None, listed.split("\0")):
        tag, path = record[0], record[2:]
        if tag.islower():
            flagged[path] = "marked assume-unchanged"
        elif tag == "S":
            flagged[path] = "marked skip-worktree"
    return flagged


def hidden_edits(repo: Repo, paths: list[str]) -> list[str]:
    """`paths` marked assume-unchanged or skip-worktree whose file is not what the index holds:
    edits `git status` never shows (or a file a sparse checkout left out). Each as "PATH (why)"."""
    flagged = _flags(repo, paths)
    if not flagged:
        return []
    staged = _read(repo, "list the index", "ls-files", "-s", "-z", "--", *flagged)
    in_index = {r.split("\t", 1)[1]: r.split()[1] for r in filter(None, staged.split("\0"))}
    top = git.work_tree(repo)
    out = []
    for path, why in flagged.items():
        if not (top / path).is_file():
            out.append(f"{path} ({why}, not in the work tree: a sparse checkout?)")
            continue
        worktree = _read(repo, "hash a file", "hash-object", f"--path={path}", "--", path)
        if worktree != in_index.get(path):
            out.append(f"{path} ({why}, with edits git status does not show)")
    return sorted(out)


def check_sparse(repo: Repo, root: Path, paths: list[str]) -> None:
    """Refuse (before planning, which would call the missing files upstream drift) when files the sets
    read or patch are left out of the work tree by a sparse checkout."""
    top = git.work_tree(repo)
    inside = []
    for path in paths:  # a link out of the repository is refused by the apply itself, with its fix
        real = (root / path).resolve()
        if real.is_relative_to(top.resolve()):
            inside.append(real.relative_to(top.resolve()).as_posix())
    left_out = sorted(
        p
        for p, why in _flags(repo, inside).items()
        if why == "marked skip-worktree" and not (top / p).exists()
    )
    if left_out:
        shown = ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else "")
        raise UserError(
            f"{shown}: in the repository but not in the work tree (a sparse checkout leaves them out), and "
            f"rl-msprobe patches them. Add them (git sparse-checkout add {Path(left_out[0]).parent.as_posix()}, "
            "or git sparse-checkout disable) and run again. Nothing was changed."
        )


def check_clean(repo: Repo, root: Path, changes: list[FileChange], allow_dirty: bool) -> None:
    """Refuse uncommitted changes (with --allow-dirty: in the files the commit touches only), hidden
    ones in those files always."""
    touched = git.repo_paths(repo, root, changes)
    hidden = hidden_edits(repo, touched)
    if hidden:
        raise UserError(
            f"{', '.join(hidden)}: would be patched, and its edits are hidden from git status; make them "
            "visible (git update-index --no-assume-unchanged / --no-skip-worktree PATH, or git sparse-checkout "
            "add), then commit or stash them. rl-msprobe never mixes your edits into its commit. Nothing was "
            "changed."
        )
    changed = dirty(repo)
    if not changed:
        return
    if not allow_dirty:
        raise UserError(
            f"{git.work_tree(repo)}: uncommitted changes ({', '.join(changed[:5])}); commit or stash "
            "them, or pass --allow-dirty (your changes are then left as they are)."
        )
    clash = sorted(set(touched) & set(changed))
    if clash:
        raise UserError(
            f"{', '.join(clash)}: has uncommitted changes and would be patched; commit or stash it first "
            "(even with --allow-dirty rl-msprobe never mixes your edits into its commit)."
        )

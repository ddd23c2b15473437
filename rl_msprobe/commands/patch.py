"""`rl-msprobe patch list | diff | apply | revert | status`: thin wrappers over `rl_msprobe.engine`
(plans, diffs, status, apply, revert) that render its results."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rl_msprobe.engine import ApplyResult, Recovered, RevertResult
    from rl_msprobe.engine.plan_parts import NotCovered
    from rl_msprobe.upstream.trees import Target

tree_option = click.option(
    "--tree",
    metavar="PATH|release:NAME==VER",
    help="The folder holding the package (or the package folder), or a release fetched from the index.",
)
python_option = click.option(
    "--python",
    "python",
    metavar="PY",
    help="Use the tree this interpreter imports (may be `docker exec -i C python3`).",
)
sets_argument = click.argument("set_names", metavar="SET...", nargs=-1)


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


def _echo_recovered(journal: Recovered | None) -> None:
    """Say what became of a run that was killed part-way (its journal was found)."""
    from rl_msprobe.engine import JournalOutcome

    if not journal:
        return
    if journal.outcome is JournalOutcome.IN_PROGRESS:
        click.echo(f"note: another rl-msprobe (pid {journal.pid}) is patching this tree right now.", err=True)
    elif journal.outcome is JournalOutcome.UNFINISHED:
        click.echo(f"note: {journal.detail}", err=True)
    else:
        click.echo(
            f"note: an interrupted `patch {journal.op}` (pid {journal.pid}) was found and "
            f"{journal.outcome.value} first ({', '.join(journal.files)}).",
            err=True,
        )


@click.group()
def patch() -> None:
    """Source patch sets for verl, SGLang, vLLM and vLLM-Ascend trees.

    A tree is --tree PATH (a checkout, an editable install or site-packages), --python PY
    (the tree that interpreter imports), or --tree release:verl==0.9.1 (fetched; diff and
    status only). Without either, diff and status use the set's default release: the newest
    release its tests run on (`patch list` shows it).
    """


@patch.command("list")
@json_option
@handles_user_errors
def list_sets(as_json: bool) -> None:
    """List the patch sets: project, supported versions, the default release (used without --tree)."""
    from rl_msprobe.patches.listing import list_sets as listing

    result = listing()
    if as_json:
        emit_json(result.to_json())
        return
    for line in result.text_lines():
        click.echo(line)


@patch.command()
@sets_argument
@tree_option
@python_option
@click.option(
    "--stat", "show_stat", is_flag=True, help="Print the summary (files, hunks, +/-) instead of the diff."
)
@click.option(
    "--exit-code",
    "exit_code",
    is_flag=True,
    help="Exit 1 when changes are pending, 0 when none (like `git diff --exit-code`).",
)
@json_option
@handles_user_errors
def diff(
    set_names: tuple[str, ...],
    tree: str | None,
    python: str | None,
    show_stat: bool,
    exit_code: bool,
    as_json: bool,
) -> None:
    """Print the unified diff applying SET... would make (stdout; the summary line goes to stderr).

    Exit 0 like `git diff`; with --exit-code, 1 when changes are pending and 0 when none.
    """
    from rl_msprobe.engine.preview import Pending, preview

    result = preview(set_names, tree, python)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(
            "".join(f"{line}\n" for line in result.stat_lines()) if show_stat else result.text, nl=False
        )
        for note in result.notes():
            click.echo(note, err=True)
    sys.exit(1 if exit_code and result.pending is Pending.CHANGES else 0)


@patch.command()
@sets_argument
@tree_option
@python_option
@click.option("--branch", metavar="NAME", help="Branch for the commit (default rl-msprobe/<sets>).")
@click.option("--no-branch", is_flag=True, help="Commit on the current branch instead of a new one.")
@click.option(
    "--allow-dirty", is_flag=True, help="Apply in a git checkout with uncommitted changes (left untouched)."
)
@click.option(
    "--for",
    "entry_point",
    metavar="ENTRY",
    help="The entry point the job runs (main_ppo, main_ppo_sync, one_step_off, fully_async; `prepare` prints "
    "it): refuse only when a capability it needs has no site.",
)
@json_option
@handles_user_errors
def apply(
    set_names: tuple[str, ...],
    tree: str | None,
    python: str | None,
    branch: str | None,
    no_branch: bool,
    allow_dirty: bool,
    entry_point: str | None,
    as_json: bool,
) -> None:
    """Apply SET... to the tree: every file or none. Applying an applied set changes nothing.

    A trainer or rollout path whose code has no site rl-msprobe knows is not covered: the rest is
    patched, it gets a guard line (it fails when it runs with collection switched on), and it is
    listed. With --for ENTRY, a capability ENTRY needs without a site refuses the apply.

    With --python, sets of several projects (`verl-consistency vllm-dump`) go to the trees that
    interpreter imports, each tree all or nothing, and the command too: when a later tree fails, the
    trees already patched are taken back.
    """
    from rl_msprobe import engine
    from rl_msprobe.engine import selection
    from rl_msprobe.errors import UserError

    if branch and no_branch:
        raise UserError("pass --branch NAME or --no-branch, not both.")
    _needs_tree("apply", tree, python)
    groups = selection.groups(set_names, tree, python)
    if entry_point:
        _check_entry_point(entry_point, [target.project for target, _ in groups])
    results = engine.apply_many(
        groups, branch=branch, make_branch=not no_branch, allow_dirty=allow_dirty, entry_point=entry_point
    )
    if as_json:
        emit_json(engine.combined_json(results))
        return
    for (target, _), result in zip(groups, results, strict=True):
        _echo_applied(target, result)


def _needs_tree(command: str, tree: str | None, python: str | None) -> None:
    """apply and revert change a tree: the user names it (a release is read-only and never the default)."""
    from rl_msprobe.errors import UserError

    if tree is None and python is None:
        raise UserError(
            f"patch {command} changes the tree that runs the job: name it with --tree PATH (the folder holding "
            "the package) or --python PY (the interpreter that runs verl; the trees it imports). Nothing was changed."
        )


def _check_entry_point(name: str, projects: list[str]) -> None:
    """--for names an entry point of a project patched here (else a UserError listing them)."""
    from rl_msprobe.patches import entry_points, get_entry_point

    having = [p for p in projects if entry_points(p)]
    get_entry_point(having[0] if having else projects[0], name)


def _echo_not_covered(
    missing: Iterable[NotCovered], by_entry: dict[str, bool], absent: tuple[str, ...], indent: str = ""
) -> None:
    """Every piece left without a site, and which entry points are covered: never silent. An entry
    point whose main module the tree lacks (`absent`) is "not in this tree", never "NOT covered"."""
    for gap in missing:
        click.echo(
            f"{indent}NOT COVERED for {gap.entry_point}: {gap.set}: capability '{gap.capability}': {gap.reason}"
        )
    shown = [
        f"{name} ({'covered' if ok else 'NOT covered'})"
        for name, ok in by_entry.items()
        if name not in absent
    ]
    if shown:
        click.echo(f"{indent}entry points: {', '.join(shown)}")
    if by_entry and absent:
        click.echo(f"{indent}entry points not in this tree: {', '.join(absent)}")


def _echo_applied(target: Target, result: ApplyResult) -> None:
    _echo_recovered(result.recovered)
    if result.noop:
        click.echo(f"{', '.join(result.sets)}: already applied to {target.describe()}; no file changed.")
        if result.git:  # its pieces came with another set: recorded, so reverting that one keeps them
            click.echo(f"git: recorded on branch {result.git.branch}, commit {result.git.commit[:12]}")
    else:
        click.echo(f"applied {', '.join(result.sets)} to {target.describe()}:")
        for path in result.changed:
            click.echo(f"  {path}")
        if result.git:
            click.echo(f"git: branch {result.git.branch}, commit {result.git.commit[:12]}")
        else:
            click.echo(f"originals kept in {result.manifest}")
    for skipped in result.skipped:
        click.echo(f"  not applicable: {skipped.piece} ({skipped.detail})")
    _echo_not_covered(result.not_covered, result.entry_points, result.not_in_tree, "  ")
    if result.not_covered:
        names = ", ".join(dict.fromkeys(gap.entry_point for gap in result.not_covered))
        _warn(
            [f"not covered: {names}: those jobs cannot collect on this tree (see above); --for refuses them"]
        )
    _warn(list(result.warnings))
    for note in dict.fromkeys(result.notes):
        click.echo(f"note: {note}")


@patch.command()
@sets_argument
@tree_option
@python_option
@json_option
@handles_user_errors
def revert(set_names: tuple[str, ...], tree: str | None, python: str | None, as_json: bool) -> None:
    """Revert SET...: the files are byte-identical to before the apply (git: a revert commit).

    With --python, sets of several projects are reverted in their trees, all or none (as apply).
    """
    from rl_msprobe import engine
    from rl_msprobe.engine import selection

    _needs_tree("revert", tree, python)
    groups = selection.groups(set_names, tree, python)
    results = engine.revert_many(groups)
    if as_json:
        emit_json(engine.combined_json(results))
        return
    for (target, _), result in zip(groups, results, strict=True):
        _echo_reverted(target, result)


def _echo_reverted(target: Target, result: RevertResult) -> None:
    _echo_recovered(result.recovered)
    for note in result.notes:
        click.echo(f"note: {note}")
    if result.noop:
        what = "no file changed" if result.kept else "not applied; nothing changed"
        click.echo(f"{', '.join(result.sets)}: {what} in {target.describe()}.")
    else:
        click.echo(f"reverted {', '.join(result.sets)} in {target.describe()}:")
    for path in result.changed:
        click.echo(f"  {path}")
    for kept in result.kept:
        click.echo(f"  kept: {kept.path} [{kept.piece}] ({kept.detail})")
    if result.git:
        click.echo(f"git: revert commit {result.git.commit[:12]} on {result.git.branch}")


@patch.command()
@sets_argument
@tree_option
@python_option
@json_option
@handles_user_errors
def status(set_names: tuple[str, ...], tree: str | None, python: str | None, as_json: bool) -> None:
    """Per set and file: applied | absent | partial | conflict (also native, not-applicable).

    Exit 0 when everything asked for is applied (or native), 1 otherwise. Without SET, every
    set for the tree's project.
    """
    from rl_msprobe import engine
    from rl_msprobe.engine import selection

    groups = selection.status_groups(set_names, tree, python)
    statuses = [engine.status(target, sets) for target, sets in groups]
    if as_json:
        emit_json(engine.combined_status_json(statuses))
    else:
        for (target, _), found in zip(groups, statuses, strict=True):
            given = "" if tree or python else " (no --tree or --python given: the set's default release)"
            click.echo(f"{target.describe()}{given}")
            _warn(list(found.warnings))
            _echo_recovered(found.journal)
            for entry in found.sets:
                click.echo(f"{entry.name}: {entry.status.value}")
                for f in entry.files:
                    click.echo(f"  {f.status.value:<15} {f.path}  [{f.piece}] {f.detail}")
                for cap in entry.capabilities:
                    click.echo(f"  capability found: {cap.name} ({', '.join(cap.sites)})")
                _echo_not_covered(entry.not_covered, entry.entry_points, entry.not_in_tree, "  ")
                for note in entry.notes:
                    click.echo(f"  note: {note}")
    sys.exit(0 if all(found.all_applied for found in statuses) else 1)

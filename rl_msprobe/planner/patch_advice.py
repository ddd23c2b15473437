"""The `rl-msprobe patch apply` commands a plan prints: which entry point the job runs and one
command per tree."""

from __future__ import annotations

from rl_msprobe.launch.script import LaunchScript


def entry_point_of(script: LaunchScript, sets: list[str]) -> tuple[str | None, list[str]]:
    """The `patch apply --for` name of the job the launch script starts (main_ppo, fully_async, ...),
    and a note when it starts a verl main whose trainer rl-msprobe cannot name (a recipe's own)."""
    from rl_msprobe.patches import entry_point_started_by, entry_points, project_of  # no set is loaded

    if script.command is None or script.command.kind != "ppo" or not sets:
        return None, []
    projects = {project_of(name) for name in sets}
    for upstream in sorted(projects):
        found = entry_point_started_by(upstream, script.command.entry)
        if found is not None:
            return found.name, []
    if "verl" not in projects:
        return None, []
    known = ", ".join(e.name for e in entry_points("verl"))
    return None, [
        f"{script.command.entry} is not an entry point whose trainer rl-msprobe knows ({known}), so the patch "
        "command has no --for: `patch apply` patches every site it finds and lists each trainer it does not "
        "cover; make sure the trainer this main runs is not in that list."
    ]


def tree_variable(project: str) -> str:
    """The shell variable a printed patch command uses for a tree nobody named (VERL_TREE, ...)."""
    return project.upper().replace("-", "_") + "_TREE"


def tree_variables(commands: list[str]) -> list[str]:
    """One line per tree variable the commands use: what to set it to, so each command pastes and runs."""
    from rl_msprobe.upstream.projects import PROJECTS

    return [
        f"set {tree_variable(p.name)} to the {p.name} tree that actually runs (the folder holding its {p.package} "
        f"package; in a container it may be /{p.package}, not your checkout), or pass --tree/--python to prepare"
        for p in PROJECTS
        if any(f'"${tree_variable(p.name)}"' in c for c in commands)
    ]


def patch_commands(sets: list[str], targets: dict[str, str], entry_point: str | None = None) -> list[str]:
    """The exact `rl-msprobe patch apply` commands: one per tree, but one for every tree a single
    --python imports (`patch apply` then patches them all or none); `--for ENTRY` last, on the
    command that patches the entry point's project."""
    from rl_msprobe.patches import entry_points, project_of  # the rows: no set is loaded

    groups: dict[tuple[str, str], list[str]] = {}  # (project, or "" for a shared --python; where) -> sets
    for name in sets:
        upstream = project_of(name)
        where = targets.get(upstream) or f'--tree "${tree_variable(upstream)}"'
        groups.setdefault(("" if where.startswith("--python ") else upstream, where), []).append(name)
    commands = []
    for (_, where), names in groups.items():
        ours = entry_point and any(e.name == entry_point for n in names for e in entry_points(project_of(n)))
        flag = f" --for {entry_point}" if ours else ""
        commands.append(f"rl-msprobe patch apply {' '.join(names)} {where}{flag}")
    return commands

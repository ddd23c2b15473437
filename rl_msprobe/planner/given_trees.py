"""The upstream trees a planner command is told about (--tree, --python): versions, where, notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Upstreams:
    """versions: project -> version (None: unknown); where: how a patch command names each tree;
    roots: each project's folder, for reading its config; notes: one line per tree found."""

    versions: dict[str, str | None] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)
    roots: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def resolve(trees: tuple[str, ...], python: str | None) -> Upstreams:
    """Upstream versions (and how to name each tree in a patch command) from --tree / --python."""
    from rl_msprobe.upstream import interpreter, projects
    from rl_msprobe.upstream.trees import detect_version, resolve_tree

    found = Upstreams()
    versions, where, roots, notes = found.versions, found.where, found.roots, found.notes
    for spec in trees:
        target = resolve_tree(spec)
        versions[target.project] = target.version
        roots.setdefault(target.project, Path(target.root))
        if not target.readonly:
            where[target.project] = f"--tree {target.root}"
        notes.append(f"{target.describe()} (from --tree {spec})")
    if python:
        packages = projects.packages()
        located = interpreter.locate_with_python(python, list(packages.values()))
        if "verl" not in versions and not located.get(packages["verl"]):
            notes.append(
                f"verl: --python {python} does not import it (is it the interpreter that runs the job?)"
            )
        for project, package in packages.items():
            location = located.get(package)
            if project in versions or not location:
                continue
            root = Path(location).parent
            versions[project] = detect_version(root, project) if root.is_dir() else None
            if root.is_dir():
                roots.setdefault(project, root)
            where[project] = f"--python {python!r}" if " " in python else f"--python {python}"
            notes.append(
                f"{project} {versions[project] or '(version unknown)'} at {root} (from --python {python})"
            )
    return found

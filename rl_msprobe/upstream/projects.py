"""The upstream projects rl-msprobe knows, in one table.

Every reader takes its facts from here: the package folder of a tree (`upstream.trees`), the
release `patch diff` reads without a tree and the newest release each project's patch sets are
tested on (`patches`), and the version the planner assumes when a script's version is unknown
(`planner`, `modes`). A leaf module, so the planner reads it without importing the patch sets
(and LibCST).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_msprobe.errors import UserError


@dataclass(frozen=True)
class Project:
    """One upstream project.

    `newest_tested`: the newest release its patch sets are tested on (tests/**/test_*release*.py),
    also the default release of `patch diff` / `patch status` without a tree. `assumed`: the
    release the planner assumes when a script's version is unknown (None: `newest_tested`).
    `native_tested`: the newest release the release tests cycle for sets that start where the
    project dumps natively (above `newest_tested`); their default release, since
    `newest_tested` is outside their range.
    """

    name: str  # the distribution name on the package index
    package: str  # the import package folder in a tree
    newest_tested: str
    assumed: str | None = None
    native_tested: str | None = None

    @property
    def assumed_version(self) -> str:
        return self.assumed or self.newest_tested


PROJECTS: tuple[Project, ...] = (
    Project("verl", "verl", newest_tested="0.9.1"),
    # the sglang-dump set stops at the last release without native msprobe support; the planner
    # assumes the newest SGLang release, which dumps natively (server argument msprobe_dump_config)
    Project("sglang", "sglang", newest_tested="0.5.10.post1", assumed="0.5.16", native_tested="0.5.12"),
    Project("vllm", "vllm", newest_tested="0.34.0"),
    Project("vllm-ascend", "vllm_ascend", newest_tested="0.30.0rc2"),
)


def project(name: str) -> Project:
    """The project called `name` (a distribution name, e.g. vllm-ascend)."""
    for item in PROJECTS:
        if item.name == name:
            return item
    raise UserError(f"unknown upstream project {name!r}; known: {', '.join(p.name for p in PROJECTS)}.")


def packages() -> dict[str, str]:
    """Project name -> import package folder, in table order."""
    return {p.name: p.package for p in PROJECTS}

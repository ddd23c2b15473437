"""`prepare`'s command-line flags as one frozen value, and the plan request they make.

click hands a command its options as keyword arguments named after each option's parameter;
`PrepareFlags(**params)` takes exactly those (a flag added to the command without a field here
is a TypeError on the first run, in every CLI test). Turning the typed text (`--steps 1,2`) into
the planner's values is pure and lives here, so the command itself only reads, calls and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_msprobe.errors import UserError

if TYPE_CHECKING:
    from rl_msprobe.planner import PlanRequest


def int_list(text: str | None, option: str) -> list[int] | None:
    """`1,2` (or `[1, 2]`) as numbers; UserError naming OPTION for anything else."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.replace(" ", "").strip("[]").split(",") if v]
    except ValueError:
        raise UserError(f"{option} {text}: write numbers separated by commas, e.g. {option} 1,2.") from None
    if any(v < 0 for v in values):
        raise UserError(f"{option} {text}: numbers must not be negative.")
    return values


@dataclass(frozen=True)
class PrepareFlags:
    """Every option of `rl-msprobe prepare`, as click parsed it (the text of list options as typed)."""

    script: str
    mode: str | None
    hint: str | None
    out_dir: str | None
    dump_dir: str | None
    level: str
    risk_level: str
    steps: str | None  # "1,2"
    ranks: str | None  # "0,1"
    task: str
    stages: str | None  # "S1,S2"
    backend: str | None
    train_backend: str | None
    pd: bool | None
    trees: tuple[str, ...]
    python: str | None
    command: int | None
    no_env_check: bool
    prefill_only: bool
    max_dump_gib: float | None
    with_weights: bool
    force: bool
    as_json: bool

    def request(self, text: str, path: str) -> PlanRequest:
        """What the planner is asked for: the script read from PATH and every choice made here."""
        from rl_msprobe.planner import PlanRequest
        from rl_msprobe.planner.modes.base import Options

        return PlanRequest(
            text,
            path,
            mode=self.mode,
            hint=self.hint,
            out_dir=self.out_dir,
            dump_dir=self.dump_dir,
            options=Options(
                level=self.level,
                risk_level=self.risk_level,
                steps=int_list(self.steps, "--steps"),
                ranks=int_list(self.ranks, "--ranks"),
                stages=[s.strip() for s in self.stages.split(",") if s.strip()] if self.stages else None,
                backend=self.backend,
                pd=self.pd,
                train_backend=self.train_backend,
                python=self.python,
                prefill_only=self.prefill_only,
                max_dump_gib=self.max_dump_gib,
            ),
            command=self.command,
            task=self.task,
            with_weights=self.with_weights,
        )

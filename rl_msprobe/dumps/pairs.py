"""Which pairs `dumps compare` compares: from the logs when both sides have them, else one to one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rl_msprobe.dumps.compare import plain_pairs
from rl_msprobe.dumps.correlate import Correlation, Pair, correlate
from rl_msprobe.dumps.layout import DISPATCH_LOG, TRAIN_LOG, walk_files
from rl_msprobe.errors import UserError


@dataclass(frozen=True)
class Selection:
    """The pairs to compare, the correlation they come from (None: plain folders, no logs),
    and how many there were before --limit."""

    pairs: list[Pair]
    correlation: Correlation | None
    total: int


def has_logs(rollout: Path, train: Path) -> bool:
    """Both sides are dump_path folders with the dispatch / train logs beside the dumps."""
    return (
        rollout.is_dir()
        and train.is_dir()
        and next(walk_files(rollout, {DISPATCH_LOG}, max_depth=2), None) is not None
        and next(walk_files(train, {TRAIN_LOG}, max_depth=2), None) is not None
    )


def select_pairs(
    rollout: Path, train: Path, train_steps: tuple[int, ...] = (), limit: int | None = None
) -> Selection:
    """The correlated pairs (with logs) or the plain one-to-one pairs, of `train_steps` only when
    given, the first `limit`; a UserError when the logs or the steps give none."""
    correlation = None
    if has_logs(rollout, train):
        correlation = correlate(rollout, train)
        pairs = correlation.pairs
        if not pairs:
            raise UserError(
                f"{rollout} / {train}: the logs give no comparable pair "
                "(see `rl-msprobe dumps correlate` for why each request was skipped)."
            )
    else:
        pairs = plain_pairs(rollout, train)
    if train_steps:
        pairs = [p for p in pairs if p.train.step in train_steps]
        if not pairs:
            raise UserError(
                f"--train-step {', '.join(map(str, train_steps))}: no pair of those training steps."
            )
    total = len(pairs)
    if limit and total > limit:
        pairs = pairs[:limit]
    return Selection(pairs, correlation, total)

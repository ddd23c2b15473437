"""Mode rules as rows of a table, and the one function that reads a table.

A mode's settings are data: each `Rule` says which Hydra key must hold which value, why, and
when the rule applies; each `EnvRule` does the same for an environment variable; each
`VersionRule` says which upstream release a mode needs. `apply` walks a table in order and
adds what applies to the `Requirements`, so adding a rule is adding a row. A value the rule
reads from the script itself (a parallel size, the rollout's dtype) is a `From`; when the
script leaves it to run time the rule becomes an unverifiable line instead of a setting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rl_msprobe.planner.modes.base import Context, EnvVar, Requirements, Setting, Violation, too_old

Condition = Callable[[Context], bool]
Text = str | Callable[[Context], str]


def always(ctx: Context) -> bool:
    return True


@dataclass(frozen=True)
class From:
    """A required value read from the context; `read` gives None when it is only known at run time."""

    read: Callable[[Context], Any]
    unknown: Text | None = None  # the unverifiable line then (None: the rule is dropped silently)
    same: Callable[[Any, Any], bool] | None = None  # (found, required) -> accepted; default: same_value


@dataclass(frozen=True)
class Rule:
    """One setting: `key` must be `value` because `why`, when `when` holds."""

    rule: str
    key: str
    value: Any  # a literal, or a From
    why: str | Callable[[Context, Any], str]  # a function of (context, value) when the text names them
    when: Condition = always
    prefix: str = ""  # '' for keys in verl's config, '++' for keys that may be absent
    accept: Callable[[Any], bool] | None = None
    required: str | None = None


@dataclass(frozen=True)
class EnvRule:
    """One environment variable the job needs (see EnvVar); `value` may be a function of the context."""

    rule: str
    name: str
    value: str | Callable[[Context], str]
    why: Text
    when: Condition = always
    workers: bool = True
    required: bool | Condition = True  # False: recommended only; a condition: required where it holds
    accept: Callable[[str], bool] | None = None


@dataclass(frozen=True)
class VersionRule:
    """`project` must be at least `minimum` (when `when` holds); `fix` says what to do otherwise."""

    rule: str
    project: str
    minimum: str
    fix: str
    when: Condition = always


def _text(text: Text, ctx: Context) -> str:
    return text if isinstance(text, str) else text(ctx)


def _setting(rule: Rule, ctx: Context, req: Requirements) -> Setting | None:
    value, accept = rule.value, rule.accept
    if isinstance(value, From):
        value = value.read(ctx)
        if value is None:
            if rule.value.unknown is not None:
                req.unverifiable.append(_text(rule.value.unknown, ctx))
            return None
        same, required_value = rule.value.same, value
        if same is not None:
            accept = lambda found: same(found, required_value)  # noqa: E731
    why = rule.why if isinstance(rule.why, str) else rule.why(ctx, value)
    return Setting(rule.rule, rule.key, value, rule.prefix, why, accept=accept, required=rule.required)


def apply(ctx: Context, req: Requirements, table: Iterable[Rule | EnvRule]) -> Requirements:
    """Add every row of `table` whose condition holds, in order (a later row for a key replaces an earlier)."""
    for row in table:
        if not row.when(ctx):
            continue
        if isinstance(row, EnvRule):
            value = row.value if isinstance(row.value, str) else row.value(ctx)
            required = row.required if isinstance(row.required, bool) else row.required(ctx)
            env = EnvVar(row.rule, row.name, value, _text(row.why, ctx), row.workers, required, row.accept)
            req.env = [e for e in req.env if e.name != row.name]
            req.env.append(env)
            continue
        setting = _setting(row, ctx, req)
        if setting is not None:
            req.add(setting)
    return req


def first_too_old(ctx: Context, table: Iterable[VersionRule]) -> Violation | None:
    """The first version rule that applies and fails (None when every release is recent enough or unknown)."""
    for row in table:
        if row.when(ctx):
            violation = too_old(ctx, row.rule, row.project, row.minimum, row.fix)
            if violation is not None:
                return violation
    return None

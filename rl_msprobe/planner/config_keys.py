"""Every override key of a launch script checked against the verl config it will meet.

Hydra is the reference: the script's overrides are composed with the trainer config of the verl
that runs the job (`--tree` / `--python`), else of the release named by the version, else of the
newest release rl-msprobe knows, and the result says which. Composition fails exactly where
verl's `@hydra.main` would fail at start; an unknown key is named with the nearest key the
config has (Hydra's own advice, `+key`, would only add the typo as a new key), and the plan is
refused before anything is written.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import bounded
from rl_msprobe.errors import UserError
from rl_msprobe.launch import config as launch_config
from rl_msprobe.launch.overrides import Item, Overrides
from rl_msprobe.launch.script import LaunchScript

_UNKNOWN = re.compile(r"Could not override '([^']+)'")
_QUOTED = re.compile(r"'([^']+)'")
MOST = 20  # unknown keys named in one error (each costs one more compose)


@dataclass(frozen=True)
class Problem:
    """One override Hydra refuses: its token, the script line, and what to say."""

    token: str
    line: int | None
    message: str


@dataclass
class KeyCheck:
    """What the check found: `problems` (each refuses the plan) and where the keys were checked."""

    checked_against: str | None  # "…/ppo_trainer.yaml (verl 0.9.1, the newest release …)"
    problems: list[Problem] = field(default_factory=list)
    unchecked: str | None = None  # why the keys could not be checked (then said, never skipped)


def _flat_keys(cfg: Any) -> tuple[list[str], set[str]]:
    """Every key of the composed config, and the keys that hold a walked mapping ('' the root)."""
    from omegaconf import DictConfig, OmegaConf

    out: list[str] = []
    dicts: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, DictConfig):
            return
        dicts.add(prefix[:-1])
        for key in node:
            name = f"{prefix}{key!s}"
            out.append(name)
            try:
                child = node._get_node(key)  # noqa: SLF001 - omegaconf's accessor without resolving
            except Exception:  # noqa: BLE001 - a node omegaconf cannot hand back is only not walked
                continue
            if isinstance(child, DictConfig) and not OmegaConf.is_missing(node, key):
                walk(child, name + ".")

    walk(cfg, "")
    return out, dicts


def nearest(key: str, known: list[str]) -> str | None:
    """The known key closest to `key`: among its siblings first, else among every key."""
    parent = key.rpartition(".")[0]
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    for pool in (siblings, known):
        found = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if found:
            return found[0]
    return None


def _item_for(overrides: Overrides, key: str) -> Item | None:
    for item in reversed(overrides.items):
        ov = item.override
        if ov is not None and key in (ov.key, ov.text, ov.key.replace("/", ".")):
            return item
    return None


def _line(script: LaunchScript, item: Item | None) -> int | None:
    return script.line_of(item.arg.word.start) if item is not None else None


def check(script: LaunchScript, composed: launch_config.ComposedConfig | None, said: str | None) -> KeyCheck:
    """Compose the script's known overrides with its config; name each key Hydra refuses."""
    if composed is None or composed.source is None:
        why = "; ".join(composed.notes) if composed is not None and composed.notes else said
        return KeyCheck(None, unchecked=why or "no verl config was found to check the keys against")
    source = composed.source
    where = f"{said}: {source.describe}" if said else source.describe
    assert script.command is not None
    overrides = Overrides(script.command.args)
    # a sweep (`a=x,y`) is the hydra.sweep rule's violation, with its own fix; the rest is composed
    tokens = [i.override.text for i in overrides.items if i.override is not None and not i.override.sweep]
    result = KeyCheck(where)
    unknown: list[tuple[str, Item | None]] = []
    for _ in range(MOST):
        cfg, problem = launch_config.compose(source, tokens)
        if problem is None:
            runtime = _runtime_items(overrides)
            known, dicts = _flat_keys(cfg) if unknown or runtime else ([], set())
            for key, item in unknown:
                close = nearest(key, known)
                token = item.override.text if item is not None and item.override is not None else key
                hint = f"did you mean {close}? " if close else ""
                result.problems.append(
                    Problem(
                        token,
                        _line(script, item),
                        f"{key} is not a key of verl's config; {hint}Fix the key (verl refuses an unknown key at "
                        "start; Hydra's +key would only add the typo as a new key)",
                    )
                )
            result.problems.extend(_values(script, overrides, cfg, composed.root))
            for item in runtime:
                key = item.arg.value.text or item.arg.word.raw
                name = key.split("=", 1)[0].strip("'\"")
                if name.startswith(("+", "~")) or "/" in name or name in known:
                    continue
                if name.rpartition(".")[0] not in dicts and name.split(".")[0] in known:
                    continue  # below a value Hydra resolves at run time: not walked here
                close = nearest(name, known)
                hint = f"did you mean {close}? " if close else ""
                result.problems.append(
                    Problem(
                        item.arg.word.raw,
                        _line(script, item),
                        f"{name} is not a key of verl's config; {hint}Fix the key (verl refuses an unknown key at start)",
                    )
                )
            return result
        match = _UNKNOWN.search(problem)
        if match is None:
            quoted = _QUOTED.findall(problem)
            item = next((i for q in quoted if (i := _item_for(overrides, q)) is not None), None)
            token = item.override.text if item is not None and item.override is not None else " ".join(tokens)
            result.problems.append(
                Problem(token, _line(script, item), f"verl's Hydra config refuses it: {problem}")
            )
            return result
        key = match.group(1)
        item = _item_for(overrides, key)
        unknown.append((key, item))
        left = [t for t in tokens if item is None or item.override is None or t != item.override.text]
        if len(left) == len(tokens):  # the token is not ours to take out: say Hydra's words
            result.problems.append(Problem(key, None, f"verl's Hydra config refuses it: {problem}"))
            return result
        tokens = left
    result.problems.extend(
        Problem(k, _line(script, i), f"{k} is not a key of verl's config") for k, i in unknown
    )
    return result


ROLLOUT_NAME = "actor_rollout_ref.rollout.name"


def verl_rollouts(root: Path | None) -> list[str] | None:
    """The rollout names verl's registry holds (`_ROLLOUT_REGISTRY` in verl/workers/rollout/base.py,
    read with `ast`, nothing imported); None when the tree has no such table."""
    import ast

    if root is None:
        return None
    path = root / "verl" / "workers" / "rollout" / "base.py"
    try:
        tree = ast.parse(bounded.read_text(str(path), "verl's rollout registry", bounded.CONFIG))
    except (UserError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_ROLLOUT_REGISTRY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            names: list[str] = []
            for key in node.value.keys:
                first = key.elts[0] if isinstance(key, ast.Tuple) and key.elts else key
                if (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and first.value not in names
                ):
                    names.append(first.value)
            return names or None
    return None


def _values(script: LaunchScript, overrides: Overrides, cfg: Any, root: Path | None) -> list[Problem]:
    """A value verl refuses at start although Hydra composes it: a rollout name its registry lacks."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, ROLLOUT_NAME, default=None, throw_on_resolution_failure=False)
    known = verl_rollouts(root)
    if not isinstance(value, str) or known is None or value in known:
        return []
    item = _item_for(overrides, ROLLOUT_NAME)
    close = difflib.get_close_matches(value, known, n=1, cutoff=0.5)
    return [
        Problem(
            f"{ROLLOUT_NAME}={value}",
            _line(script, item),
            f"{value!r} is not a rollout verl knows (its rollout registry holds {', '.join(known)}); "
            + (f"did you mean {close[0]}? " if close else "")
            + "verl refuses it at start",
        )
    ]


def _runtime_items(overrides: Overrides) -> list[Item]:
    """Arguments whose key is readable but whose value is only known at run time (`key=$X`)."""
    out = []
    for item in overrides.items:
        if item.override is not None or item.arg.value.text is not None:
            continue
        raw = item.arg.word.raw
        if re.match(r"""^['"]?[A-Za-z_][A-Za-z0-9_.]*=""", raw):
            out.append(item)
    return out


def refuse(path: str, found: KeyCheck) -> None:
    """A UserError naming every override Hydra refuses (exit 2, nothing written)."""
    if not found.problems:
        return
    lines = [f"{path}{f':{p.line}' if p.line else ''}: {p.token}: {p.message}." for p in found.problems]
    lines.append(f"Checked against {found.checked_against}. Nothing was written.")
    raise UserError("\n".join(lines))

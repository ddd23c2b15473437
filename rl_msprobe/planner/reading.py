"""A launch script read for the planner: parsed (a UserError names the line), its mode detected, and
the verl config it composes against read when a tree is known."""

from __future__ import annotations

from pathlib import Path

from rl_msprobe.errors import UserError
from rl_msprobe.launch import config as launch_config
from rl_msprobe.launch.bash_lexer import ShellSyntaxError
from rl_msprobe.launch.detect import Detection, detect
from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import LaunchScript, parse_script
from rl_msprobe.planner.modes.base import (
    Violation,
)
from rl_msprobe.upstream.projects import project
from rl_msprobe.upstream.release_cache import release_dir


def read(text: str, path: str, command: int | None = None) -> LaunchScript:
    """Parse a script; a syntax error or a missing verl command is a UserError naming the line.

    `command`: which verl command (1-based) when the script runs several (default: the last
    training job)."""
    try:
        script = parse_script(text, path)
        if command is not None:
            script.choose(command)
    except ShellSyntaxError as exc:
        raise UserError(f"{path}: {exc}. Fix the shell syntax (bash -n {path} shows it too).") from None
    except ValueError as exc:
        raise UserError(f"{path}: {exc}. Pass a number in that range.") from None
    if script.command is None:
        raise UserError(
            f"{path}: no verl command found (python3 -m verl.trainer.main_ppo, "
            "verl.experimental.fully_async_policy.fully_async_main, or a main_*.py script). "
            "Pass the script that launches the verl job."
        )
    return script


def detect_text(
    text: str,
    path: str,
    hint: str | None = None,
    command: int | None = None,
    verl_root: Path | None = None,
    verl_version: str | None = None,
) -> tuple[LaunchScript, Detection]:
    """Parse and detect; with a verl tree (or a cached release of `verl_version`, else the newest,
    for a script that names its own config), read the composed config too."""
    script = read(text, path, command)
    assert script.command is not None
    overrides = Overrides(script.command.args)
    composed = read_config(script, overrides, verl_root, verl_version)
    if composed is None:
        return script, detect(script, hint, overrides)
    where = composed.source.describe if composed.source is not None else None
    detection = detect(script, hint, overrides, composed.values, where)
    detection.composed = composed
    detection.reasons.extend(composed.notes)
    return script, detection


def read_config(
    script: LaunchScript, overrides: Overrides, verl_root: Path | None, verl_version: str | None = None
) -> launch_config.ComposedConfig | None:
    """The composed config, when a verl tree is known (None: the DEFAULTS table describes the job)."""
    assert script.command is not None
    names_config = any(f in overrides.flags for f in ("--config-path", "--config-name", "-cp", "-cn"))
    own_config = names_config or not script.command.entry.startswith("verl.")
    if verl_root is None:
        if not own_config:
            return None
        version = verl_version or project("verl").assumed_version
        cached = release_dir("verl", version)
        if not (cached / "verl" / "trainer" / "config").is_dir():
            script.notes.append(
                "the script names its own config: pass --tree or --python (the verl that runs it) to read it"
            )
            return None
        verl_root = cached
        script.notes.append(f"config read against verl {version} (cached release; pass --tree to choose)")
    # verl's own default config: the DEFAULTS table (checked against real releases) describes it;
    # it is still located, so a derived command is composed against it
    return launch_config.read(script, overrides, verl_root, values=own_config)


def compose_violation(
    script: LaunchScript, detection: Detection, original: LaunchScript | None = None
) -> Violation | None:
    """A violation when the command's overrides do not compose against the config it uses
    (`original`: the user's script, to say whether it fails the same way)."""
    composed = detection.composed
    if not isinstance(composed, launch_config.ComposedConfig) or composed.source is None:
        return None
    assert script.command is not None
    tokens = launch_config.known_tokens(Overrides(script.command.args))
    _, problem = launch_config.compose(composed.source, tokens)
    if problem is None:
        return None
    fix = f"Hydra refuses the command as verl would: {problem}"
    if original is not None and original.command is not None:
        _, before = launch_config.compose(
            composed.source, launch_config.known_tokens(Overrides(original.command.args))
        )
        if before is not None:
            fix += (
                " — the original command fails the same way against this config: is it the verl version the "
                "script was written for? (pass --tree or --python with the verl that runs it)"
            )
    return Violation(
        "hydra.compose",
        composed.source.name,
        problem,
        f"overrides that compose with {composed.source.describe}",
        fix,
    )

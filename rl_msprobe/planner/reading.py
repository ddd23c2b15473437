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
from rl_msprobe.planner import config_keys
from rl_msprobe.planner.config_keys import KeyCheck
from rl_msprobe.planner.modes.base import (
    Violation,
)
from rl_msprobe.upstream.projects import project
from rl_msprobe.upstream.release_cache import fetch_release, release_dir


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


def refuse_crlf(text: str, path: str) -> None:
    """A script with Windows (CRLF) line endings: bash reads each line's carriage return as part of its
    last word (`\\` no longer continues the line, `key=2\\r` is not the value written), so the job would
    not run as written; a UserError naming the line endings (exit 2, nothing written)."""
    crlf = text.count("\r\n")
    if not crlf:
        return
    first = text[: text.index("\r\n")].count("\n") + 1
    raise UserError(
        f"{path}:{first}: the script has Windows (CRLF) line endings ({crlf} of {text.count(chr(10))} lines end in "
        "\\r\\n): bash takes each \\r as part of the line's last word, so the verl command would not run as "
        f"written. Convert it to Unix line endings (dos2unix {path}, or sed -i 's/\\r$//' {path}) and run again. "
        "Nothing was written."
    )


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
    """The config the command composes against: the tree's (`verl_root`), else the release of
    `verl_version`, else the newest release rl-msprobe knows (fetched into the cache once), and
    whose it is in `said`. Its values are read only for a script that names its own config (verl's
    own default config: the DEFAULTS table, checked against real releases, describes it)."""
    assert script.command is not None
    names_config = any(f in overrides.flags for f in ("--config-path", "--config-name", "-cp", "-cn"))
    own_config = names_config or not script.command.entry.startswith("verl.")
    said = "the verl tree given"
    if verl_root is None:
        version = verl_version or project("verl").assumed_version
        why = (
            f"the verl {version} release (the version given)"
            if verl_version
            else f"verl {version}, the newest release rl-msprobe knows (pass --tree or --python with the verl that "
            "runs the job)"
        )
        verl_root, problem = _release(version)
        if verl_root is None:
            note = f"override keys not checked: verl {version}'s config could not be read ({problem}); pass --tree"
            return launch_config.ComposedConfig(None, notes=[note], said=note)
        said = why
    composed = launch_config.read(script, overrides, verl_root, values=own_config)
    composed.said, composed.root = said, verl_root
    return composed


def _release(version: str) -> tuple[Path | None, str]:
    """The cached release of verl `version`, fetched from the package index when not there yet."""
    cached = release_dir("verl", version)
    if (cached / "verl" / "trainer" / "config").is_dir():
        return cached, ""
    try:
        root = fetch_release("verl", version)
    except UserError as exc:
        return None, str(exc).splitlines()[0]
    return (
        (root, "")
        if (root / "verl" / "trainer" / "config").is_dir()
        else (None, f"{root} has no trainer config")
    )


def check_keys(script: LaunchScript, detection: Detection) -> KeyCheck:
    """The script's overrides composed with the config `detect_text` found (UserError when Hydra
    refuses any: exit 2, nothing written); the check's note goes to the script's notes."""
    assert script.command is not None
    if script.command.kind not in (
        "ppo",
        "generation_server",
    ):  # no mode applies: the entry point rule says so
        return KeyCheck(None)
    composed = detection.composed if isinstance(detection.composed, launch_config.ComposedConfig) else None
    found = config_keys.check(script, composed, composed.said if composed is not None else None)
    config_keys.refuse(script.path, found)
    if found.checked_against is not None:
        script.notes.append(f"override keys checked against {found.checked_against}")
    return found


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

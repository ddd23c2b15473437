"""The `rl-msprobe` command: a click group whose sub-commands load on demand.

Each area (patching, launch-script planning, dump analysis) keeps its thin click
functions in `rl_msprobe/commands/<area>.py`; this group only knows their names and
one-line help, so `rl-msprobe --help` imports neither libcst nor git.
Exit codes everywhere: 0 success, 1 "found something", 2 bad input.
"""

from __future__ import annotations

import importlib
import io
import sys

import click

from rl_msprobe import __version__

# name -> (module, attribute, one-line help shown by `rl-msprobe --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "env": ("rl_msprobe.commands.planner", "env", "Check (and install) msprobe in the training interpreter."),
    "detect": ("rl_msprobe.commands.planner", "detect", "Decide the collection mode of a launch script."),
    "prepare": (
        "rl_msprobe.commands.planner",
        "prepare",
        "Write a derived launch script and msprobe configs.",
    ),
    "check": ("rl_msprobe.commands.planner", "check", "Check a launch script against the rules of a mode."),
    "patch": ("rl_msprobe.commands.patch", "patch", "Diff, apply, revert and inspect source patch sets."),
    "dumps": ("rl_msprobe.commands.dumps", "dumps", "Check, correlate and compare collected dumps."),
    "weights": (
        "rl_msprobe.commands.weights",
        "weights",
        "Compare the actor's weights with the engine's after every sync.",
    ),
    "mismatch": (
        "rl_msprobe.commands.mismatch",
        "mismatch",
        "Report the rollout vs training log-prob gap of a triage run.",
    ),
}


class LazyGroup(click.Group):
    """A group that imports a sub-command only when it is run or asked for help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name, attr, _ = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command), f"COMMANDS names {module_name}.{attr}, not a click command"
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, _, short) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rl-msprobe")
def main() -> None:
    """Prepare verl RL jobs for msprobe precision dumps.

    Typical flow: `env` (msprobe in the training Python), `detect` / `prepare` (derived
    launch script and configs), `patch apply` (dump hooks in verl / SGLang / vLLM trees),
    run the job, then `dumps check | correlate | compare`.
    """
    # a file or folder name that is not UTF-8 is printed as its bytes (Python's surrogates), never a
    # UnicodeEncodeError, whatever locale or PYTHONIOENCODING the shell has
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="surrogateescape")

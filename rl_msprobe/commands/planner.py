"""`rl-msprobe env | detect | prepare | check`: thin click commands over the planner.

Heavy imports stay inside the functions so `rl-msprobe --help` stays light.
Exit codes: 0 ok, 1 found something (msprobe missing, mode unknown, violations, refused), 2 bad input.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option
from rl_msprobe.commands.planner_options import (
    backend_option,
    command_option,
    hint_option,
    mode_option,
    model_config_option,
    prepare_options,
    python_option,
    train_backend_option,
    tree_option,
)
from rl_msprobe.commands.prepare_flags import PrepareFlags


@click.command()
@click.option(
    "--python", "python", default="python3", show_default=True, metavar="PY", help="The training interpreter."
)
@click.option("--no-install", is_flag=True, help="Only check; never install.")
@json_option
@handles_user_errors
def env(python: str, no_install: bool, as_json: bool) -> None:
    """Check that msprobe imports in the training Python; install mindstudio-probe there if not.

    Exit 0 when `from msprobe.pytorch import PrecisionDebugger` works, 1 otherwise (with the
    two manual commands). Do not go on to prepare or patch until this passes.
    """
    from rl_msprobe.planner import env as env_mod

    report = env_mod.ensure(python, no_install=no_install)
    if as_json:
        emit_json(report.to_json())
    else:
        for line in report.lines():
            click.echo(line)
    sys.exit(0 if report.ok else 1)


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@hint_option
@command_option
@tree_option
@python_option
@json_option
@handles_user_errors
def detect(
    script: str,
    hint: str | None,
    command: int | None,
    trees: tuple[str, ...],
    python: str | None,
    as_json: bool,
) -> None:
    """Decide the collection mode, rollout engine and training backend of SCRIPT.

    Exit 0 when the mode is decided, 1 when it is not (then choose --mode yourself).
    """
    from rl_msprobe.planner.api import detect_script

    result = detect_script(script, hint, command, trees, python)
    if as_json:
        emit_json(result.to_json())
    else:
        for line in result.lines():
            click.echo(line)
    sys.exit(0 if result.ok else 1)


@click.command()
@prepare_options
@json_option
@handles_user_errors
def prepare(**params: Any) -> None:
    """Write a derived launch script and its msprobe configs; never touch SCRIPT.

    Prints the diff original -> derived and what is left to do (patch sets to apply).
    Exit 0 when written and the derived script passes `check`, 1 when refused or rules
    remain unmet, 2 on bad input.
    """
    from rl_msprobe.planner.api import prepare_script

    flags = PrepareFlags(**params)
    result = prepare_script(flags, argv=sys.argv[1:])
    if flags.as_json:
        emit_json(result.to_json())
    else:
        for line in result.errors():
            click.echo(line, err=True)
        click.echo(result.text(), nl=False)
    sys.exit(0 if result.ok else 1)


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@mode_option
@backend_option
@train_backend_option
@hint_option
@tree_option
@python_option
@command_option
@click.option(
    "--batch-one",
    is_flag=True,
    help="Consistency: check the original skill's plan (batch 1, TP = devices); a script prepare derived says "
    "its plan in its header, which check reads.",
)
@model_config_option
@json_option
@handles_user_errors
def check(
    script: str,
    mode: str | None,
    backend: str | None,
    train_backend: str | None,
    hint: str | None,
    trees: tuple[str, ...],
    python: str | None,
    command: int | None,
    batch_one: bool,
    model_config: str | None,
    as_json: bool,
) -> None:
    """Check SCRIPT (derived or hand-written) against every rule of its collection mode.

    Exit 0 when every rule holds, 1 on violations, 2 on bad input.
    """
    from rl_msprobe.planner.api import check_script

    result = check_script(
        script,
        mode,
        backend,
        train_backend,
        hint,
        trees,
        python,
        command,
        batch_one,
        model_config=model_config,
    )
    if as_json:
        emit_json(result.to_json())
    else:
        for line in result.lines():
            click.echo(line)
    sys.exit(0 if result.ok else 1)

"""`rl-msprobe weights compare DIR`: thin click layer over rl_msprobe.weights.

Exit codes like `dumps compare`: 0 EQUAL, 1 DIFFERENT or NOT COMPARED, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option

_MODEL_DIR = click.Path(file_okay=False, path_type=Path)


@click.group()
def weights() -> None:
    """Weight parity after every sync (the verl-weights patch set's fingerprints)."""


@weights.command()
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write weights.md, weights.html, weights.json here.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace files in --out that rl-msprobe did not write (or that were edited).",
)
@click.option(
    "--checkpoint",
    type=_MODEL_DIR,
    help="A model folder (safetensors): compare it with what the engine holds at --sync instead.",
)
@click.option(
    "--sync",
    type=click.IntRange(1),
    default=None,
    help="With --checkpoint: the sync whose resident fingerprints are compared (default: the first).",
)
@json_option
@handles_user_errors
def compare(as_json: bool, **params: Any) -> None:
    """Compare what the actor sent, what each engine rank received and what it holds, per sync.

    FOLDER is <dump-dir>/weights of a run prepared with --mode weights (or --weights). Per
    tensor: equal, differs (beyond what the dtypes allow) or missing; stage `received` (differs
    from what was sent: the transfer) or `resident` (what the engine holds or its loader wrote
    differs from what it received). Exit 0 EQUAL, 1 DIFFERENT or NOT COMPARED.
    """
    from rl_msprobe.weights.api import compare_weights

    result = compare_weights(**params)
    if as_json:
        emit_json(result.to_json())
    else:
        for line in result.lines():
            click.echo(line)
    sys.exit(0 if result.ok else 1)

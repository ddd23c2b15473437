"""`rl-msprobe env | detect | prepare | check`: thin click commands over the planner.

Heavy imports stay inside the functions so `rl-msprobe --help` stays light.
Exit codes: 0 ok, 1 found something (msprobe missing, mode unknown, violations, refused), 2 bad input.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from rl_msprobe.commands.common import emit_json, handles_user_errors, json_option
from rl_msprobe.commands.prepare_flags import PrepareFlags
from rl_msprobe.planner import registry


def _read_script(path: str) -> tuple[str, str]:
    from rl_msprobe import bounded

    abs_path = os.path.abspath(path)
    return bounded.read_text(abs_path, "verl launch script", bounded.LAUNCH_SCRIPT), abs_path


def _echo_list(title: str, items: list[str]) -> None:
    if items:
        click.echo(f"{title}:")
        for item in items:
            click.echo(f"  - {item}")


def _echo_violations(violations: list[dict[str, str]]) -> None:
    if violations:
        click.echo("violations:")
        for v in violations:
            click.echo(
                f"  - [{v['rule']}] {v['key']}: found {v['found'] or '-'}, required {v['required'] or '-'}"
            )
            click.echo(f"      fix: {v['fix']}")


tree_option = click.option(
    "--tree",
    "trees",
    multiple=True,
    metavar="T",
    help="An upstream tree (path or release:NAME==VER) whose version matters (verl, sglang, vllm-ascend); repeatable.",
)
train_backend_option = click.option(
    "--train-backend",
    type=click.Choice(["fsdp", "megatron"]),
    help="The training backend, when the script does not say.",
)
python_option = click.option(
    "--python",
    "python",
    metavar="PY",
    help="The training interpreter (may be `docker exec -i NAME python3`).",
)
mode_option = click.option(
    "--mode",
    type=click.Choice(registry.mode_names()),
    help=registry.mode_help(),
)
hint_option = click.option(
    "--hint", metavar="TEXT", help="What you want to collect, in words (Chinese or English)."
)
command_option = click.option(
    "--command",
    "command",
    type=click.IntRange(min=1),
    metavar="N",
    help="Which verl command of the script (1 = the first) when it runs several (default: the last training job).",
)
backend_option = click.option(
    "--backend",
    type=click.Choice(["vllm", "sglang"]),
    help="The rollout engine, when the script does not say.",
)


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
        where = f"{report.executable} (Python {report.python_version})" if report.executable else python
        if report.ok and report.installed_now:
            click.echo(
                f"msprobe was missing in {where}: INSTALLED {env_mod.PACKAGE} {report.version or ''} there "
                f"(`{python} -m pip install {env_mod.PACKAGE}`); it imports now."
            )
        elif report.ok:
            click.echo(
                f"msprobe {report.version or '(version unknown)'} is importable in {where}; nothing installed."
            )
        else:
            click.echo(f"msprobe is NOT importable in {where}: {report.error}")
            if no_install:
                click.echo("--no-install: nothing was installed.")
            elif report.install_attempted:
                click.echo("Installing it failed; pip said:")
                for line in report.install_log.strip().splitlines()[-5:]:
                    click.echo(f"  | {line}")
                click.echo("Install it yourself, then verify.")
            click.echo("Manual commands:")
            for cmd in report.manual_commands():
                click.echo(f"  {cmd}")
            click.echo("Stop here: do not prepare, patch or launch a dump until msprobe imports.")
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
    from rl_msprobe import planner
    from rl_msprobe.planner.given_trees import resolve

    text, path = _read_script(script)
    found = resolve(trees, python)
    _, detection = planner.detect_text(text, path, hint, command, found.roots.get("verl"))
    if as_json:
        emit_json(detection.to_json())
    else:
        click.echo(f"mode: {detection.mode}")
        click.echo(f"rollout: {detection.rollout}")
        click.echo(f"train_backend: {detection.train_backend}")
        _echo_list("reasons", detection.reasons)
    sys.exit(0 if detection.mode != "unknown" else 1)


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@mode_option
@hint_option
@click.option(
    "--out",
    "out_dir",
    metavar="DIR",
    help="Where to write the derived script (default: beside the original).",
)
@click.option(
    "--dump-dir",
    metavar="DIR",
    help="Dump root for inference/consistency (default: DIR/msprobe_<name>/dump).",
)
@click.option(
    "--level", default="mix", show_default=True, type=click.Choice(["mix", "L0", "L1"]), help="msprobe level."
)
@click.option(
    "--risk-level",
    default="FOCUS",
    show_default=True,
    type=click.Choice(["ALL", "FOCUS", "CORE"]),
    help="msprobe risk_level at L1 / mix: FOCUS (msprobe's own default, written explicitly) drops "
    "reshape / view / transpose / cat / to and other low-risk calls; ALL keeps every API call (a vLLM "
    "rollout dump then runs ~60x slower); CORE keeps only matmul, linear, "
    "norm, embedding and attention calls. Module rows are always dumped.",
)
@click.option(
    "--steps",
    metavar="1,2",
    help="Training: global_profiler.steps (default 1,2). Inference: msprobe step list (default 0). "
    "Consistency: msprobe step list (default: every step; each side counts its own dumped forwards).",
)
@click.option("--ranks", metavar="0,1", help="msprobe rank list (default: all ranks).")
@click.option(
    "--task",
    type=click.Choice(["statistics", "tensor"]),
    default="statistics",
    show_default=True,
    help="msprobe dump task: statistics (max/min/mean/norm per tensor), or tensor (whole tensors: "
    "cosine and element-wise errors in dumps compare; large, use with --level L0).",
)
@click.option("--stages", metavar="S1,S2", help="Training stages (default: all three).")
@backend_option
@train_backend_option
@click.option("--pd/--no-pd", default=None, help="SGLang prefill/decode disaggregation (default: detected).")
@tree_option
@python_option
@command_option
@click.option(
    "--no-env-check", is_flag=True, help="Do not check msprobe in --python first (you take the risk)."
)
@click.option(
    "--prefill-only",
    is_flag=True,
    help="Consistency: compare the prompt's prefill only (no per-token record of the actor's forward over "
    "the response, DUMP_POSITIONS unset).",
)
@click.option(
    "--max-dump-gib",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Consistency: refuse when the estimated dump of one training step exceeds this (default 50).",
)
@click.option(
    "--weights",
    "with_weights",
    is_flag=True,
    help="Also fingerprint the weights at every sync (what --mode weights does), under <dump-dir>/weights.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Overwrite files in the way that rl-msprobe did not write (or that were edited).",
)
@json_option
@handles_user_errors
def prepare(**params: Any) -> None:
    """Write a derived launch script and its msprobe configs; never touch SCRIPT.

    Prints the diff original -> derived and what is left to do (patch sets to apply).
    Exit 0 when written and the derived script passes `check`, 1 when refused or rules
    remain unmet, 2 on bad input.
    """
    from rl_msprobe.planner.prepare import MsprobeMissing
    from rl_msprobe.planner.prepare import prepare as prepare_plan

    flags = PrepareFlags(**params)
    as_json = flags.as_json
    text, path = _read_script(flags.script)
    result = prepare_plan(
        flags.request(text, path),
        flags.trees,
        env_check=not flags.no_env_check,
        force=flags.force,
        argv=sys.argv[1:],
    )
    if isinstance(result, MsprobeMissing):
        if as_json:
            emit_json(result.to_json())
        else:
            click.echo(result.message, err=True)
        sys.exit(1)
    doc = result.to_json()
    if as_json:
        emit_json(doc)
    else:
        if result.refused:
            click.echo(f"Refused: {path} cannot be prepared for {result.mode} collection.")
            _echo_violations(doc["violations"])
        else:
            click.echo(result.diff, nl=False)
            _echo_list("changed (rule: the value it needs, and why)", [c.line() for c in result.changes])
            click.echo(f"wrote {result.derived_path}")
            for role, cfg in doc["configs"].items():
                click.echo(f"wrote {cfg}  ({role} msprobe config)")
            if doc["configs"]:
                click.echo(_msprobe_line(result.msprobe))
            _echo_violations(doc["violations"])
            todo = []
            todo += [f"apply the patches: {cmd}" for cmd in result.patch_commands]
            if result.patch_commands:
                todo.append(
                    "patch the tree that actually runs (inside a container it may be /verl, not your checkout)"
                )
            todo.append(f"check: rl-msprobe check {result.derived_path} --mode {result.mode}")
            todo.append(f"run: bash {result.derived_path}")
            _echo_list("still to do", todo)
        _echo_list("unverifiable", result.unverifiable)
        _echo_list("warnings", result.warnings)
        _echo_list("notes", result.notes)
    sys.exit(1 if result.refused or result.violations else 0)


def _msprobe_line(settings: dict[str, str]) -> str:
    """What every msprobe config written says about what is dumped (risk_level explained)."""
    risk = settings.get("risk_level", "")
    what = {
        "ALL": "every API call",
        "FOCUS": "low-risk calls (reshape, view, transpose, cat, to, ...) left out",
        "CORE": "only matmul / linear / norm / embedding / attention calls",
    }.get(risk, "")
    return (
        f"msprobe configs: level {settings.get('level')}, task {settings.get('task')}, "
        f"risk_level {risk} ({what}; --risk-level to change)"
    )


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@mode_option
@backend_option
@train_backend_option
@hint_option
@tree_option
@python_option
@command_option
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
    as_json: bool,
) -> None:
    """Check SCRIPT (derived or hand-written) against every rule of its collection mode.

    Exit 0 when every rule holds, 1 on violations, 2 on bad input.
    """
    from rl_msprobe import planner
    from rl_msprobe.planner.given_trees import resolve

    text, path = _read_script(script)
    found = resolve(trees, python)
    report = planner.check(
        text,
        path,
        mode=mode,
        backend=backend,
        hint=hint,
        versions=found.versions,
        train_backend=train_backend,
        command=command,
        verl_root=found.roots.get("verl"),
        patch_target=found.where,
        vllm_root=found.roots.get("vllm"),
    )
    report.notes = [*found.notes, *report.notes]
    doc = report.to_json()
    if as_json:
        emit_json(doc)
    else:
        status = "ok" if report.result.ok else f"{len(report.result.violations)} violation(s)"
        click.echo(f"{path}: {report.mode} rules: {status}")
        _echo_violations(doc["violations"])
        _echo_list("patches this job needs", report.patch_commands)
        _echo_list("unverifiable", report.result.unverifiable)
        _echo_list("warnings", report.result.warnings)
        _echo_list("notes", report.notes)
    sys.exit(0 if report.result.ok else 1)

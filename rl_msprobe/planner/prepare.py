"""One `prepare` run: msprobe in the training interpreter, the plan, the files it writes.

The command parses options into a PlanRequest and renders what `prepare` returns; everything
between (the msprobe probe, the upstream trees, the command line to regenerate, the files written
all or nothing) happens here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass

from rl_msprobe.mode_table import needs_msprobe
from rl_msprobe.planner import msprobe_config, outputs
from rl_msprobe.planner.env import EnvReport
from rl_msprobe.planner.given_trees import resolve
from rl_msprobe.planner.planning import Plan, PlanRequest, plan


@dataclass(frozen=True)
class MsprobeMissing:
    """prepare stopped before planning: msprobe does not import in --python."""

    message: str
    env: EnvReport

    def to_json(self) -> dict[str, object]:
        return {"written": False, "error": self.message, "env": self.env.to_json()}


def prepare(
    request: PlanRequest,
    trees: tuple[str, ...] = (),
    *,
    env_check: bool = True,
    force: bool = False,
    argv: list[str] | None = None,
) -> Plan | MsprobeMissing:
    """Probe msprobe in `request.options.python`, plan against the given trees, write the derived script,
    its configs and the --python record (all or nothing; refused plans write nothing).

    `argv`: the command line as given (sys.argv[1:]), for the derived script's "Regenerate with"."""
    notes: list[str] = []
    python = request.options.python
    if needs_msprobe(request.mode):
        if python and env_check:
            from rl_msprobe.planner import env

            report = env.probe(python)
            if not report.ok:
                return MsprobeMissing(
                    f"msprobe is not importable in {python} ({report.error}). Run `rl-msprobe env --python "
                    f"{python}` first, or pass --no-env-check to prepare anyway.",
                    report,
                )
            notes.append(f"msprobe {report.version} imports in {python}.")
        elif not python:
            notes.append(
                "msprobe not checked: run `rl-msprobe env --python PY` with the interpreter that runs verl."
            )
    found = resolve(trees, python)
    request = dataclasses.replace(
        request,
        versions=found.versions,
        patch_target=found.where,
        verl_root=found.roots.get("verl"),
        vllm_root=found.roots.get("vllm"),
        regenerate=regenerate_command(request.path, argv or []),
    )
    result = plan(request)
    if result.refused:
        return dataclasses.replace(result, notes=[*found.notes, *notes, *result.notes])
    files, record_dir = _files(result, python)
    recorded = [f"recorded --python in {files[-1].path}: `rl-msprobe dumps compare` runs msprobe there."]
    result = dataclasses.replace(
        result,
        notes=[*found.notes, *notes, *result.notes, *(recorded if python and result.configs else [])],
    )
    outputs.write(files, record_dir, request.path, request.text.encode("utf-8"), force)
    return result


def _files(result: Plan, python: str | None) -> tuple[list[outputs.Output], str]:
    """The derived script, its configs and (with --python) the interpreter record, and the folder
    that keeps the record of what rl-msprobe wrote."""
    files = [outputs.Output(result.derived_path, result.derived_text, executable=True)]
    files += [outputs.Output(cfg, msprobe_config.dumps(doc)) for cfg, doc in result.configs.values()]
    record_dir = os.path.dirname(files[-1].path) if len(files) > 1 else os.path.dirname(result.derived_path)
    if python and result.configs:
        files.append(_python_record(python, [c for c, _ in result.configs.values()]))
    return files, record_dir


def _python_record(python: str, config_paths: list[str]) -> outputs.Output:
    """The training interpreter, left beside the configs; the default dump folders lie below
    them, where `dumps compare` looks it up (rl_msprobe.dumps.compare.recorded_python)."""
    from rl_msprobe.dumps.compare import PYTHON_RECORD

    record = os.path.join(os.path.dirname(config_paths[0]), PYTHON_RECORD)
    return outputs.Output(record, json.dumps({"python": python}) + "\n")


def regenerate_command(path: str, argv: list[str]) -> str | None:
    """The prepare command line as given (minus --json), with the script as an absolute path."""
    if "prepare" not in argv:
        return None
    args = [a for a in argv[argv.index("prepare") + 1 :] if a != "--json"]
    args = [path if a and os.path.abspath(a) == path else a for a in args]
    return shlex.join(["rl-msprobe", "prepare", *args])

"""Where `tensor_files` runs: here when torch imports, else in the interpreter that has msprobe."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

HELPER = Path(__file__).with_name("tensor_files.py")
TIMEOUT = 600.0


def here(python: list[str] | None) -> bool:
    return (python is None or python == [sys.executable]) and importlib.util.find_spec("torch") is not None


def run(op: str, jobs: list[JsonObject], python: list[str] | None = None) -> list[JsonObject]:
    """The results of `tensor_files` op OP on JOBS (one per job); UserError naming the first
    file when torch is nowhere to be had or a job fails."""
    if not jobs:
        return []
    request: JsonObject = {"op": op, "jobs": jobs}
    reply: object
    if here(python):
        from rl_msprobe.dumps import tensor_files

        reply = tensor_files.handle(request)
    else:
        if python is None:
            raise UserError(
                f"{jobs[0].get('files', [jobs[0].get('src')])[0]}: tensor-mode dumps need torch to be read, "
                "and it does not import here. Pass the training interpreter: --python /path/to/python."
            )
        try:
            proc = subprocess.run(
                [*python, "-c", HELPER.read_text(encoding="utf-8")],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UserError(f"could not run the tensor helper in {python[0]}: {exc}") from None
        try:
            reply = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise UserError(
                f"the tensor helper in {python[0]} gave no reply (exit {proc.returncode}):\n{tail}"
            ) from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise UserError(f"tensor files ({op}): {error}")
    results = reply.get("results")
    return [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []

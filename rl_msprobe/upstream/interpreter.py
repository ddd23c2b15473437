"""Another Python interpreter (maybe `docker exec -i NAME python3`): its argv, and where it would
import packages from, asked without importing them."""

from __future__ import annotations

import json
import shlex
import subprocess

from rl_msprobe.errors import UserError


def python_argv(python: str) -> list[str]:
    """The --python value as an argv (it may be `docker exec -i NAME python3`); exit 2 when it cannot be."""
    try:
        argv = shlex.split(python)
    except ValueError as exc:
        raise UserError(
            f"--python {python}: cannot be read as a command ({exc}); check its quotes, "
            "e.g. --python 'docker exec -i NAME python3'."
        ) from None
    if not argv:
        raise UserError(
            "--python is empty: pass an interpreter such as `python3` or `docker exec -i NAME python3`."
        )
    return argv


_FIND_SPEC = (
    "import importlib.util, json, sys\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        spec = importlib.util.find_spec(name)\n"
    "    except Exception:\n"
    "        spec = None\n"
    "    locs = list(spec.submodule_search_locations or []) if spec else []\n"
    "    out[name] = locs[0] if locs else None\n"
    "print(json.dumps(out))\n"
)


def locate_with_python(python: str, packages: list[str]) -> dict[str, str | None]:
    """Ask an interpreter (maybe `docker exec -i NAME python3`) where packages live, without importing them."""
    argv = python_argv(python)
    try:
        proc = subprocess.run(
            [*argv, "-c", _FIND_SPEC, *packages],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=120,
            check=False,
        )
    except FileNotFoundError as exc:
        raise UserError(
            f"--python {python}: {exc.filename} was not found. Pass a working interpreter."
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"--python {python}: no answer within 120 s.") from exc
    except OSError as exc:
        raise UserError(
            f"--python {python}: cannot be run ({exc.strerror}). Pass a working interpreter."
        ) from exc
    if proc.returncode != 0:
        raise UserError(f"--python {python} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError):
        found = None
    if not isinstance(found, dict) or not all(isinstance(v, (str, type(None))) for v in found.values()):
        raise UserError(
            f"--python {python}: unexpected output {proc.stdout[-200:]!r} (not the JSON rl-msprobe's probe prints); "
            "pass the Python interpreter itself."
        )
    return found

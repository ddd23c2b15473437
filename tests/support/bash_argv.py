"""Let bash itself say what argument vectors a launch script passes to python / torchrun / ray.

The script runs under `bash` with PATH holding only recorder stubs (python, python3, torchrun,
ray, ...) that append their argv to a file and exit 0; every other command is a no-op
(`command_not_found_handle`), `source` / `.` are disabled, stdin is empty, HOME and the working
folder are a temporary folder. So nothing the script names is run, while bash does all of the
expanding (quotes, arrays, `${X:-default}`, continuations) exactly as on the user's machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

RECORDED = (
    "python",
    "python3",
    "python3.10",
    "python3.11",
    "python3.12",
    "torchrun",
    "ray",
    "accelerate",
    "uv",
)
_WRAPPERS = "nohup|env|stdbuf|numactl|taskset|srun|mpirun|timeout|sudo|exec"
_STUB = """#!/bin/sh
printf '%s\\0' "${0##*/}" "$@" >> "$ARGV_RECORD"
printf '\\1\\0' >> "$ARGV_RECORD"
"""
_ENV = f"""enable -n source .
command_not_found_handle() {{
  case "$1" in
    {_WRAPPERS})
      shift
      while [ $# -gt 0 ]; do
        case "$1" in *=*|-*|[0-9]*) shift ;; *) break ;; esac
      done
      [ $# -gt 0 ] && "$@" ;;
  esac
  return 0
}}
"""
BASH = shutil.which("bash")


def record(script: Path, work: Path, timeout: float = 20) -> list[list[str]]:
    """The argv of every recorded command the script runs, in order (program name first).

    HOME and the working folder are `work`/home for every script recorded under `work`, so
    two scripts recorded there expand `$HOME`, `$PWD` and relative paths alike."""
    assert BASH is not None
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    for name in RECORDED:
        stub = stubs / name
        stub.write_text(_STUB.replace("#!/bin/sh", f"#!{shutil.which('sh')}"))
        stub.chmod(0o755)
    env_file = work / "bash_env.sh"
    env_file.write_text(_ENV)
    out = work / f"argv-{script.name}.bin"
    out.write_bytes(b"")
    home = work / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": str(stubs), "BASH_ENV": str(env_file), "ARGV_RECORD": str(out), "HOME": str(home)}
    subprocess.run(
        [BASH, str(script)],
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )
    calls: list[list[str]] = []
    current: list[str] = []
    for field in out.read_bytes().split(b"\0")[:-1]:
        if field == b"\1":
            calls.append(current)
            current = []
        else:
            current.append(os.fsdecode(field))
    return calls

"""How `msprobe compare` is run: one long-lived worker per job (default), or one process per pair.

msprobe's import costs seconds (pandas, scipy, ...; 5-10 s seen on a live CPU job) and the
compare of one small pair well under that, so a process per pair spends most of its time
importing. A `WorkerRunner` starts `msprobe_worker.py` once in the interpreter that has msprobe
(`--python PY`, the training interpreter; or this one) and feeds it pair after pair; a pair
that kills or hangs the worker costs that pair only (the next pair starts a fresh worker).
`ProcessRunner` keeps the former one-process-per-pair path (benchmarks, and the test that both
write the same CSV rows).
"""

from __future__ import annotations

import importlib.util
import json
import select
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rl_msprobe.errors import UserError
from rl_msprobe.jsontypes import JsonObject

WORKER = Path(__file__).with_name("msprobe_worker.py")
START_TIMEOUT = 300.0  # seconds for msprobe's import in a fresh worker


def interpreter(python: str | None) -> list[str]:
    """argv of the Python that runs msprobe: --python PY; else this one when it has msprobe; else
    the interpreter of an `msprobe` script on PATH (its #! line)."""
    if python:
        from rl_msprobe.upstream.interpreter import python_argv

        argv = python_argv(python)
        if shutil.which(argv[0]) is None:  # bad input (exit 2), not a pair that failed (exit 1)
            raise UserError(
                f"--python {python}: {argv[0]} was not found or cannot be run; pass the training "
                "interpreter, e.g. --python /venv/bin/python."
            )
        return argv
    if importlib.util.find_spec("msprobe") is not None:
        return [sys.executable]
    exe = shutil.which("msprobe")
    if exe:
        from rl_msprobe import bounded

        try:  # its shebang line (a FIFO or device on PATH is no msprobe: never opened)
            with bounded.open_regular(exe, "msprobe script") as f:
                first = f.readline(4096).decode(errors="replace").strip()
        except (OSError, UserError):
            first = ""
        if first.startswith("#!") and "python" in first:
            return shlex.split(first[2:])
    raise UserError(
        "msprobe is not importable in this Python, and no `msprobe` is on PATH. Pass the training "
        "interpreter that has it: `rl-msprobe dumps compare ... --python /path/to/python` "
        "(or install it here: `pip install mindstudio-probe`)."
    )


def _log_failure(log: Path, what: str) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n[rl-msprobe] {what}\n")


class ProcessRunner:
    """`PY -m msprobe.msprobe compare ...` in a fresh process for every pair."""

    def __init__(self, python: list[str]):
        self.python = python

    def run(self, args: list[str], log: Path, timeout: float | None) -> int | str:
        cmd = [*self.python, "-m", "msprobe.msprobe", *args]
        with open(log, "ab") as f:
            f.write((shlex.join(cmd) + "\n").encode())
            f.flush()
            try:
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                return "timeout"
            except OSError as exc:
                return f"could not start {self.python[0]}: {exc}"
        return proc.returncode

    def close(self) -> None:
        pass


class WorkerRunner:
    """One msprobe_worker process, started on first use and again after a pair killed it."""

    def __init__(self, python: list[str], stderr_log: Path):
        self.python = python
        self.stderr_log = stderr_log
        self.proc: subprocess.Popen[str] | None = None
        self.import_seconds: float | None = None  # msprobe's import in the current worker
        self.pair_seconds: float | None = None  # the last pair, measured inside the worker

    def _read(self, timeout: float | None) -> JsonObject | None:
        """The next reply line, or None when the worker died or `timeout` passed."""
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        if timeout is not None:
            ready, _, _ = select.select([out], [], [], timeout)
            if not ready:
                return None
        line = out.readline()
        if not line:
            return None
        try:
            reply = json.loads(line)
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def _start(self) -> str | None:
        """Start a worker; an error text when it could not import msprobe."""
        self.stderr_log.parent.mkdir(parents=True, exist_ok=True)
        err = open(self.stderr_log, "ab")  # noqa: SIM115 - lives as long as the worker
        try:
            self.proc = subprocess.Popen(
                [*self.python, "-c", WORKER.read_text(encoding="utf-8")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        except OSError as exc:
            err.close()
            self.proc = None
            return f"could not start {self.python[0]}: {exc}"
        finally:
            if self.proc is not None:
                err.close()
        reply = self._read(START_TIMEOUT)
        if not reply or not reply.get("ready"):
            why = (reply or {}).get(
                "error"
            ) or f"the worker exited before msprobe was imported ({self.stderr_log})"
            self._stop()
            return f"msprobe does not import in {shlex.join(self.python)}: {why}"
        self.import_seconds = float(reply.get("import_s") or 0.0)
        return None

    def run(self, args: list[str], log: Path, timeout: float | None) -> int | str:
        if self.proc is None or self.proc.poll() is not None:
            error = self._start()
            if error:
                _log_failure(log, error)
                return error
        assert self.proc is not None and self.proc.stdin is not None
        with open(log, "ab") as f:
            f.write(("msprobe " + shlex.join(args) + "\n").encode())
        try:
            self.proc.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self._stop()
            return "the msprobe worker exited"
        started = time.monotonic()
        reply = self._read(timeout)
        if reply is None:
            timed_out = timeout is not None and time.monotonic() - started >= timeout
            code = self.proc.poll()
            self._stop()
            what = "timeout" if timed_out else f"the msprobe worker died during this pair (exit {code})"
            _log_failure(log, what)
            return what
        self.pair_seconds = float(reply.get("seconds") or 0.0)
        return int(reply.get("rc", 1))

    def _stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream:
                    stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def close(self) -> None:
        self._stop()

"""msprobe in the *training* interpreter: is it importable, and install it when it is not.

The interpreter may be a command prefix (`docker exec -i NAME python3`): everything runs
through it, including pip, so msprobe lands where verl runs — never in rl-msprobe's own
environment.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

from rl_msprobe.errors import UserError
from rl_msprobe.upstream.interpreter import python_argv

PACKAGE = "mindstudio-probe"
IMPORT_CHECK = "from msprobe.pytorch import PrecisionDebugger"
MARKER = "RL_MSPROBE_ENV:"
_PROBE = f"""
import json, sys
info = {{"python": sys.executable, "python_version": sys.version.split()[0], "ok": False, "error": None, "version": None}}
try:
    {IMPORT_CHECK}
    info["ok"] = True
except BaseException as exc:
    info["error"] = type(exc).__name__ + ": " + str(exc)
try:
    import importlib.metadata as md
    info["version"] = md.version("{PACKAGE}")
except Exception:
    pass
print("{MARKER}" + json.dumps(info), flush=True)
"""


@dataclass
class EnvReport:
    python: str
    ok: bool
    version: str | None = None
    executable: str | None = None
    python_version: str | None = None
    error: str | None = None
    installed_now: bool = False
    install_attempted: bool = False
    install_log: str = ""
    steps: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The terminal text of `env`: what imports where, what was installed, else what to do."""
        where = f"{self.executable} (Python {self.python_version})" if self.executable else self.python
        if self.ok and self.installed_now:
            return [
                f"msprobe was missing in {where}: INSTALLED {PACKAGE} {self.version or ''} there "
                f"(`{self.python} -m pip install {PACKAGE}`); it imports now."
            ]
        if self.ok:
            return [
                f"msprobe {self.version or '(version unknown)'} is importable in {where}; nothing installed."
            ]
        out = [f"msprobe is NOT importable in {where}: {self.error}"]
        if not self.install_attempted:  # `ensure` installs whenever it may: not tried is --no-install
            out.append("--no-install: nothing was installed.")
        else:
            out.append("Installing it failed; pip said:")
            out += [f"  | {line}" for line in self.install_log.strip().splitlines()[-5:]]
            out.append("Install it yourself, then verify.")
        out += ["Manual commands:", *(f"  {cmd}" for cmd in self.manual_commands())]
        return [*out, "Stop here: do not prepare, patch or launch a dump until msprobe imports."]

    def manual_commands(self) -> list[str]:
        """The specification's two manual commands, spelled for this interpreter."""
        py = self.python
        return [f"{py} -m pip install {PACKAGE}", f"{py} -c \"{IMPORT_CHECK}; print('OK')\""]

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "schema": "rl-msprobe.env/1",
            "ok": self.ok,
            "python": self.python,
            "executable": self.executable,
            "python_version": self.python_version,
            "msprobe_version": self.version,
            "installed_now": self.installed_now,
            "installed": f"{PACKAGE}=={self.version}" if self.installed_now and self.version else None,
            "install_attempted": self.install_attempted,
            "error": self.error,
            "steps": self.steps,
        }
        if not self.ok:
            doc["manual_commands"] = self.manual_commands()
        if self.install_attempted:
            doc["install_log_tail"] = self.install_log.strip().splitlines()[-20:]
        return doc


def probe(python: str, timeout: float = 300) -> EnvReport:
    """Run the import check in that interpreter (msprobe's import takes a few seconds)."""
    argv = python_argv(python)
    try:
        proc = subprocess.run(
            [*argv, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise UserError(
            f"--python {python}: {exc.filename} was not found. Pass the interpreter that runs verl."
        ) from None
    except OSError as exc:
        raise UserError(
            f"--python {python}: cannot be run ({exc.strerror}). Pass the interpreter that runs verl."
        ) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"--python {python}: no answer within {timeout:.0f} s.") from None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            info = json.loads(line[len(MARKER) :])
            return EnvReport(
                python,
                bool(info["ok"]),
                info.get("version"),
                info.get("python"),
                info.get("python_version"),
                info.get("error"),
            )
    raise UserError(
        f"--python {python} did not run the check (exit {proc.returncode}): "
        f"{(proc.stderr or proc.stdout).strip()[-300:]}. Pass a working Python interpreter."
    )


def install(python: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """`PY -m pip install mindstudio-probe`, with that interpreter's own pip."""
    return subprocess.run(
        [*python_argv(python), "-m", "pip", "install", "--disable-pip-version-check", PACKAGE],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ensure(python: str, no_install: bool = False) -> EnvReport:
    """Check; install when missing (unless no_install); check again."""
    report = probe(python)
    report.steps.append(f"check: {IMPORT_CHECK} -> {'ok' if report.ok else 'missing'}")
    if report.ok or no_install:
        return report
    report.steps.append(f"install: {python} -m pip install {PACKAGE}")
    try:
        proc = install(python)
        log = (proc.stdout + proc.stderr).strip()
        failed = proc.returncode != 0
    except subprocess.TimeoutExpired:
        log, failed = "pip install timed out", True
    after = probe(python)
    after.install_attempted = True
    after.install_log = log[-2000:]
    after.installed_now = after.ok
    after.steps = [*report.steps, f"check again -> {'ok' if after.ok else 'missing'}"]
    if failed and not after.ok:
        after.error = f"pip install failed: {log.strip().splitlines()[-1] if log.strip() else 'no output'}"
    return after

"""A long-lived msprobe compare process: import msprobe once, then run `msprobe compare` pair after pair.

Runs in the *training* interpreter (`dumps compare --python PY`), which has msprobe but not
rl-msprobe: it imports only the standard library and msprobe, and is started as
`PY -c <this file's text>` so that no path to it needs to exist there (it also works through
`docker exec -i NAME python3`).

msprobe exports no Python compare API, so each pair drives msprobe's own command entry
(`msprobe.msprobe.main` with `sys.argv = ["msprobe", "compare", ...]`) in this process, with
file descriptors 1 and 2 sent to that pair's msprobe.log, exactly what `msprobe compare` would
print. A pair that raises (or calls sys.exit) is reported with its exit code and the worker goes
on; a pair that kills the process is detected by the parent, which starts a fresh worker.

Protocol, one JSON object per line: the worker prints {"ready": true, "import_s": S} (or
{"ready": false, "error": E}) on its original stdout, then for each request line
{"args": [...], "log": PATH} on stdin answers {"rc": N, "seconds": S}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the checker: the worker needs nothing beyond the standard library at run time
    from collections.abc import Callable


def _run_pair(main: Callable[[], object], args: list[str], log: str) -> int:
    """msprobe's command line entry for one pair, its output in LOG; returns the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    rc = 0
    try:
        sys.argv = ["msprobe", *args]
        main()
    except SystemExit as exc:
        code = exc.code
        rc = code if isinstance(code, int) else (0 if code is None else 1)
    except Exception:  # one pair's failure is reported; the worker goes on
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return rc


def serve() -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints between pairs must not reach the reply channel
    start = time.monotonic()
    try:
        from msprobe.msprobe import main

        try:  # what msprobe's compare imports on its first pair (torch); none of it is required here
            import msprobe.pytorch.compare.pt_compare  # noqa: F401
        except Exception:  # noqa: BLE001 - the pair itself reports it
            pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        reply.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    reply.write(json.dumps({"ready": True, "import_s": round(time.monotonic() - start, 3)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        began = time.monotonic()
        rc = _run_pair(main, request["args"], request["log"])
        reply.write(json.dumps({"rc": rc, "seconds": round(time.monotonic() - began, 3)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve())

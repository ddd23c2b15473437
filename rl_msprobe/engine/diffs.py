"""Diffs of a plan that `git apply` and `patch -p1` accept, and their summary (read back with unidiff)."""

from __future__ import annotations

import difflib
from typing import Any

from rl_msprobe.engine.plan_parts import FileChange
from rl_msprobe.engine.sources import decode


def unified_diff(changes: list[FileChange]) -> str:
    """A diff with a/ b/ paths that `git apply` and `patch -p1` accept."""
    out: list[str] = []
    for change in changes:
        old = (
            decode(change.before, change.path).splitlines(keepends=True) if change.before is not None else []
        )
        new = decode(change.after, change.path).splitlines(keepends=True) if change.after is not None else []
        a = f"a/{change.path}" if change.before is not None else "/dev/null"
        b = f"b/{change.path}" if change.after is not None else "/dev/null"
        out.append(f"diff --git a/{change.path} b/{change.path}\n")
        if change.before is None:
            out.append("new file mode 100644\n")
        elif change.after is None:
            out.append("deleted file mode 100644\n")
        for line in difflib.unified_diff(old, new, a, b, n=3):
            if line.startswith(("---", "+++")):
                out.append(line if line.endswith("\n") else line + "\n")
                continue
            if line.endswith("\n"):
                out.append(line)
            else:
                out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


def summarize(diff_text: str) -> dict[str, Any]:
    """Files, hunks and +/- counts, read back from the diff with unidiff."""
    from unidiff.patch import PatchSet as UnidiffPatchSet

    parsed = UnidiffPatchSet(diff_text)
    files = [
        {
            "path": (f.target_file if f.target_file != "/dev/null" else f.source_file)[2:],
            "hunks": len(f),
            "added": f.added,
            "removed": f.removed,
        }
        for f in parsed
    ]
    return {
        "files": files,
        "hunks": sum(f["hunks"] for f in files),
        "added": parsed.added,
        "removed": parsed.removed,
    }

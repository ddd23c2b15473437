"""Build and validate msprobe `config.json` documents (mindstudio-probe 26.x rules).

Roles: `training` (verl's global_profiler sets the dump path, so the config must not),
`generate` (rollout dump: must set `dump_path`), `actor` (consistency training side: must
set `dump_path`). Every config uses `"level": "mix"` unless the user asked for L0 or L1, and
says its `risk_level`: msprobe 26.x defaults it to FOCUS, which leaves the low-risk API calls
(reshape, view, transpose, cat, to, clone, ... `LOW_RISK_API_SET` in msprobe's
`api_risk_level.py`) out of L1 and mix dumps. rl-msprobe writes FOCUS unless asked, so the dump no
longer depends on msprobe's default of the day: ALL made a vLLM rollout dump ~60x slower
(2026-12-03, vLLM CPU 0.32, tiny Qwen2, 16 tokens in-process: 37-38 s against 0.57-0.60 s), the
time spent in the wrapped low-risk calls outside the dumped forward. ALL is for a hunt that needs
the casts and reshapes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_msprobe import bounded
from rl_msprobe.errors import UserError

LEVELS = ("mix", "L0", "L1")
ALL_LEVELS = ("L0", "L1", "L2", "mix", "debug")
TASKS = ("statistics", "tensor", "structure")
# msprobe's filter of API rows at level L1 / mix (module rows are always kept): ALL keeps every
# call, FOCUS (msprobe 26.x's default) drops the low-risk ones, CORE keeps only matmul / conv /
# linear / norm / embedding / attention and the fused framework kernels
RISK_LEVELS = ("ALL", "FOCUS", "CORE")
DEFAULT_RISK_LEVEL = "FOCUS"  # see the module docstring: ALL costs ~60x on a vLLM rollout
NPU_ONLY_TASKS = (
    "overflow_check",
    "free_benchmark",
    "run_ut",
    "grad_probe",
    "nan_check",
    "acc_check",
    "exception_dump",
)
TOP_KEYS = {
    "task",
    "dump_path",
    "rank",
    "step",
    "level",
    "risk_level",
    "async_dump",
    "enable_dataloader",
    "extra_info",
    "seed",
    "is_deterministic",
}
TASK_KEYS = {
    "statistics": {"scope", "list", "tensor_list", "data_mode", "summary_mode"},
    "tensor": {
        "scope",
        "list",
        "data_mode",
        "bench_path",
        "diff_nums",
        "file_format",
        "online_run_ut",
        "nfs_path",
        "host",
        "port",
    },
    "structure": set(),
}
DATA_MODES = {"all", "forward", "backward", "input", "output"}
SUMMARY_MODES = {"statistics", "md5", "xor"}
DUMP_PATH_RE = re.compile(r"^[a-zA-Z0-9_.:/-]+$")


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    severity: str = "error"  # error | warning

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "message": self.message, "severity": self.severity}


def build_config(
    role: str,
    dump_path: str | None,
    *,
    level: str = "mix",
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    task: str = "statistics",
    risk_level: str = DEFAULT_RISK_LEVEL,
) -> dict[str, Any]:
    """A config for one role; `dump_path` must be absolute (and None for `training`)."""
    if level not in ALL_LEVELS:
        raise ValueError(f"level {level!r}: use one of {', '.join(LEVELS)}")
    if risk_level not in RISK_LEVELS:
        raise ValueError(f"risk_level {risk_level!r}: use one of {', '.join(RISK_LEVELS)}")
    doc: dict[str, Any] = {"task": task}
    if role != "training":
        if not dump_path:
            raise ValueError(f"the {role} config needs a dump_path")
        doc["dump_path"] = dump_path
    doc.update(
        {
            "rank": list(ranks or []),
            "step": list(steps or []),
            "level": level,
            "risk_level": risk_level,
            "async_dump": False,
        }
    )
    if task == "statistics":
        doc["statistics"] = {
            "scope": [],
            "list": [],
            "tensor_list": [],
            "data_mode": ["all"],
            "summary_mode": "statistics",
        }
    elif task == "tensor":
        doc["tensor"] = {"scope": [], "list": [], "data_mode": ["all"]}
    return doc


def _steps_ok(value: object) -> bool:
    if not isinstance(value, list):
        return False
    for item in value:
        if isinstance(item, bool):
            return False
        if isinstance(item, int):
            if not 0 <= item <= 1_000_000:
                return False
        elif isinstance(item, str):
            match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
            if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
                return False
        else:
            return False
    return True


def validate(doc: object, role: str | None = None) -> list[Problem]:
    """Everything msprobe would reject or silently ignore, plus the mode's own rules."""
    problems: list[Problem] = []
    if not isinstance(doc, dict):
        return [Problem("", "the config must be a JSON object")]
    task = doc.get("task", "statistics")
    if task in NPU_ONLY_TASKS:
        problems.append(
            Problem("task", f"task {task!r} is NPU- or MindSpore-only; use statistics, tensor or structure")
        )
    elif task not in TASKS:
        problems.append(Problem("task", f"task {task!r} is unknown; use statistics, tensor or structure"))
    for key in doc:
        if key not in TOP_KEYS and key not in TASK_KEYS and key not in NPU_ONLY_TASKS:
            problems.append(Problem(key, f"unknown key {key!r}: msprobe ignores it silently", "warning"))
    if "dump_path" in doc:
        path = doc["dump_path"]
        if not isinstance(path, str) or not path:
            problems.append(Problem("dump_path", "dump_path must be a non-empty string"))
        elif not DUMP_PATH_RE.match(path):
            problems.append(
                Problem(
                    "dump_path",
                    f"dump_path {path!r} has characters msprobe refuses (allowed: letters, digits, _ . : / -)",
                )
            )
        elif not path.startswith("/"):
            problems.append(
                Problem(
                    "dump_path",
                    f"dump_path {path!r} is relative: Ray workers resolve it in their own cwd",
                    "warning",
                )
            )
    for key in ("rank", "step"):
        if key in doc and not _steps_ok(doc[key]):
            problems.append(
                Problem(key, f"{key} must be a list of ints in [0, 1000000] or strings 'N' / 'N-M'")
            )
    level = doc.get("level", "L1")
    if level not in ALL_LEVELS:
        problems.append(Problem("level", f"level {level!r} is unknown; use mix, L0 or L1"))
    problems.extend(_risk_level_problems(doc, level))
    found = doc.get(task)
    section: dict[str, Any] = found if isinstance(found, dict) else {}
    if level == "L2" and (task != "tensor" or len(section.get("list", [])) != 1):
        problems.append(Problem("level", "level L2 needs task tensor and a one-item list"))
    if "async_dump" in doc:
        if not isinstance(doc["async_dump"], bool):
            problems.append(Problem("async_dump", "async_dump must be true or false"))
        elif doc["async_dump"] and task == "tensor" and not section.get("list"):
            problems.append(Problem("async_dump", "async_dump with task tensor needs a non-empty list"))
        elif doc["async_dump"] and section.get("summary_mode") == "md5":
            problems.append(Problem("async_dump", "async_dump does not work with summary_mode md5"))
    if isinstance(doc.get(task), dict):
        allowed = TASK_KEYS.get(task, set())
        for key, value in section.items():
            where = f"{task}.{key}"
            if key not in allowed:
                problems.append(
                    Problem(
                        where, f"unknown key {key!r} in the {task} section: msprobe ignores it", "warning"
                    )
                )
            elif key == "scope" and not (isinstance(value, list) and len(value) in (0, 2)):
                problems.append(Problem(where, "scope must be empty or exactly two names"))
            elif key == "data_mode":
                if not isinstance(value, list) or not value or not set(value) <= DATA_MODES:
                    problems.append(
                        Problem(where, f"data_mode must be a non-empty subset of {sorted(DATA_MODES)}")
                    )
                elif "all" in value and len(value) > 1:
                    problems.append(Problem(where, "data_mode 'all' must stand alone"))
            elif key == "summary_mode" and value not in SUMMARY_MODES:
                problems.append(Problem(where, f"summary_mode must be one of {sorted(SUMMARY_MODES)}"))
    if role == "training" and "dump_path" in doc:
        problems.append(
            Problem(
                "dump_path",
                "the training config must not set dump_path: verl's global_profiler sets it (save_path)",
            )
        )
    if role in ("generate", "actor", "prefill", "decode") and "dump_path" not in doc:
        problems.append(Problem("dump_path", f"the {role} config must set dump_path (an absolute folder)"))
    return problems


def _risk_level_problems(doc: dict[str, Any], level: object) -> list[Problem]:
    """An unknown risk_level is refused by msprobe; an absent one is FOCUS at L1 / mix (a warning)."""
    if "risk_level" in doc:
        value = doc["risk_level"]
        if value not in RISK_LEVELS:
            return [Problem("risk_level", f"risk_level {value!r} is unknown; use {', '.join(RISK_LEVELS)}")]
        return []
    if level in ("L1", "mix"):
        return [
            Problem(
                "risk_level",
                "risk_level is not set: msprobe 26.x then uses FOCUS, which leaves reshape / view / transpose / "
                'cat / to and other low-risk calls out of the dump; set "risk_level" ("FOCUS", or "ALL" to keep '
                "every call) so the dump does not depend on msprobe's default",
                "warning",
            )
        ]
    return []


def load(path: str | Path) -> tuple[object, str | None]:
    """Read a config file: (document, None) or (None, why it cannot be read)."""
    try:
        return json.loads(bounded.read_text(path, "an msprobe config", bounded.CONFIG)), None
    except FileNotFoundError:
        return None, f"{path} does not exist (yet)"
    except (OSError, ValueError, RecursionError, UserError) as exc:
        return None, f"{path} is not readable JSON: {exc}"


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"

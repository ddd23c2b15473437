"""The consistency plan a derived script was prepared with, written in its header and read back.

`prepare --mode consistency` writes one comment line with the flags that decide its plan
(`--batch-one`, `--requests`, `--steps`, ...), including what it decided itself (the request
count fitted to the default budget); `check --mode consistency` reads that line and applies
the same plan, so a derived script passes its own check wherever it is checked.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any

from rl_msprobe.launch.render import comment
from rl_msprobe.planner.modes.base import Options

PREFIX = "rl-msprobe consistency plan:"
_LINE = re.compile(r"^#\s*" + re.escape(PREFIX) + r"(.*)$", re.MULTILINE)


def plan_flags(options: Options, decided: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The flags of OPTIONS that shape the consistency plan, then those the plan DECIDED."""
    flags: list[str] = []
    if options.batch_one:
        flags.append("--batch-one")
    if options.requests is not None and "--requests" not in decided:
        flags += ["--requests", str(options.requests)]
    for request_id in options.request_ids:
        flags += ["--request", request_id]
    if options.layers is not None:
        flags += ["--layers", ",".join(str(n) for n in options.layers)]
    if options.modules:
        flags += ["--modules", options.modules]
    if options.steps is not None:
        flags += ["--steps", ",".join(str(n) for n in options.steps)]
    for flag, on in (
        ("--from-checkpoint", options.from_checkpoint),
        ("--prefill-compare", options.prefill_compare),
        ("--prefill-only", options.prefill_only),
    ):
        if on:
            flags.append(flag)
    if options.max_dump_gib is not None:
        flags += ["--max-dump-gib", f"{options.max_dump_gib:g}"]
    if options.level != "mix":
        flags += ["--level", options.level]
    if options.model_config:  # check reads the same model from the header
        flags += ["--model-config", options.model_config]
    return [*flags, *decided]


def plan_line(options: Options, decided: list[str] | tuple[str, ...] = ()) -> str:
    flags = plan_flags(options, decided)
    return comment(f"{PREFIX} {shlex.join(flags) if flags else '(the defaults)'}")


def read_plan(text: str) -> dict[str, Any]:
    """Options fields from the plan line of a derived script's header ({} when it has none or it
    does not parse: the defaults apply)."""
    found = _LINE.search(text)
    if found is None:
        return {}
    body = found.group(1).strip()
    try:
        words = [] if body == "(the defaults)" else shlex.split(body)
    except ValueError:
        return {}
    out: dict[str, Any] = {}
    ids: list[str] = []
    switches = {
        "--batch-one": "batch_one",
        "--from-checkpoint": "from_checkpoint",
        "--prefill-compare": "prefill_compare",
        "--prefill-only": "prefill_only",
    }
    it = iter(words)
    try:
        for word in it:
            if word in switches:
                out[switches[word]] = True
            elif word == "--requests":
                out["requests"] = int(next(it))
            elif word == "--request":
                ids.append(next(it))
            elif word == "--layers":
                out["layers"] = tuple(int(n) for n in next(it).split(",") if n)
            elif word == "--modules":
                out["modules"] = next(it)
            elif word == "--steps":
                out["steps"] = [int(n) for n in next(it).split(",") if n]
            elif word == "--max-dump-gib":
                out["max_dump_gib"] = float(next(it))
            elif word == "--level":
                out["level"] = next(it)
            elif word == "--model-config":
                out["model_config"] = next(it)
    except (StopIteration, ValueError):
        return {}
    if ids:
        out["request_ids"] = tuple(ids)
    return out


def options_from(text: str, options: Options) -> Options:
    """OPTIONS with the plan of TEXT's header line on top."""
    return dataclasses.replace(options, **read_plan(text))

"""The `prepare` and `check` operations, callable from Python without click.

`prepare_script(PrepareOptions(script=...))` and `check_script(script, ...)` read the launch
script, resolve the upstream trees and return a frozen outcome: its state is an enum, its
`to_json()` is the command's `--json` document (schemas in docs/json.md) and its `text()` is
what the command prints.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rl_msprobe.errors import UserError
from rl_msprobe.planner.patch_advice import tree_variables

if TYPE_CHECKING:
    from rl_msprobe.launch.detect import Detection
    from rl_msprobe.planner import PlanRequest
    from rl_msprobe.planner.checking import CheckReport
    from rl_msprobe.planner.planning import Plan
    from rl_msprobe.planner.prepare import MsprobeMissing

PREPARE_SCHEMA = "rl-msprobe.prepare/1"
CHECK_SCHEMA = "rl-msprobe.check/1"


def read_script(path: str) -> tuple[str, str]:
    """The launch script's text (bounded) and its absolute path."""
    from rl_msprobe import bounded

    abs_path = os.path.abspath(path)
    return bounded.read_text(abs_path, "verl launch script", bounded.LAUNCH_SCRIPT), abs_path


def int_list(text: str | None, option: str) -> list[int] | None:
    """`1,2` (or `[1, 2]`) as numbers; UserError naming OPTION for anything else."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.replace(" ", "").strip("[]").split(",") if v]
    except ValueError:
        raise UserError(f"{option} {text}: write numbers separated by commas, e.g. {option} 1,2.") from None
    if any(v < 0 for v in values):
        raise UserError(f"{option} {text}: numbers must not be negative.")
    return values


def _tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def request_ids(ids: tuple[str, ...]) -> tuple[str, ...]:
    """--request ID (repeatable; `a,b` also splits): base request ids, as verl made them."""
    out = [part.strip() for given in ids for part in given.split(",") if part.strip()]
    bad = [i for i in out if not all(c.isalnum() or c in "-_." for c in i)]
    if bad:
        raise UserError(
            f"--request {bad[0]}: a request id has letters, digits, - _ . only (as verl makes them)."
        )
    return tuple(dict.fromkeys(out))


def module_regex(text: str | None) -> str | None:
    """--modules REGEX, compiled once here so a bad one is bad input (exit 2), not a job that records nothing."""
    if text is None:
        return None
    import re

    try:
        re.compile(text)
    except re.error as error:
        raise UserError(f"--modules {text}: not a regular expression ({error}).") from None
    return text


@dataclass(frozen=True)
class PrepareOptions:
    """Every choice of `prepare` (defaults as the command's; list options as typed: "1,2")."""

    script: str
    mode: str | None = None
    hint: str | None = None
    out_dir: str | None = None
    dump_dir: str | None = None
    level: str = "mix"
    risk_level: str = "FOCUS"
    steps: str | None = None  # "1,2"
    ranks: str | None = None  # "0,1"
    task: str = "statistics"
    stages: str | None = None  # "S1,S2"
    backend: str | None = None
    train_backend: str | None = None
    pd: bool | None = None
    trees: tuple[str, ...] = ()
    python: str | None = None
    command: int | None = None
    no_env_check: bool = False
    prefill_only: bool = False
    model_config: str | None = None  # --model-config PATH
    max_dump_gib: float | None = None
    batch_one: bool = False
    requests: int | None = None
    request_ids: tuple[str, ...] = ()  # --request ID, repeatable
    layers: str | None = None  # "0,27"
    modules: str | None = None  # a regex
    from_checkpoint: bool = False
    prefill_compare: bool = False
    top_k: int = 20
    with_weights: bool = False
    force: bool = False
    zoom: str | None = None  # consistency: a `dumps positions --json` report
    zoom_request: str | None = None
    zoom_layer: int | None = None
    zoom_module: str | None = None
    zoom_position: int | None = None

    def request(self, text: str, path: str) -> PlanRequest:
        """What the planner is asked for: the script read from PATH and every choice made here."""
        from rl_msprobe.planner import PlanRequest
        from rl_msprobe.planner.modes.base import Options

        return PlanRequest(
            text,
            path,
            mode=self.mode,
            hint=self.hint,
            out_dir=self.out_dir,
            dump_dir=self.dump_dir,
            options=Options(
                level=self.level,
                risk_level=self.risk_level,
                steps=int_list(self.steps, "--steps"),
                ranks=int_list(self.ranks, "--ranks"),
                stages=[s.strip() for s in self.stages.split(",") if s.strip()] if self.stages else None,
                backend=self.backend,
                pd=self.pd,
                train_backend=self.train_backend,
                python=self.python,
                prefill_only=self.prefill_only,
                max_dump_gib=self.max_dump_gib,
                model_config=os.path.abspath(self.model_config) if self.model_config else None,
                batch_one=self.batch_one,
                requests=self.requests,
                request_ids=request_ids(self.request_ids),
                layers=_tuple(int_list(self.layers, "--layers")),
                modules=module_regex(self.modules),
                from_checkpoint=self.from_checkpoint,
                prefill_compare=self.prefill_compare,
                top_k=self.top_k,
                zoom=self.zoom_target(),
            ),
            command=self.command,
            task=self.task,
            with_weights=self.with_weights,
        )

    def zoom_target(self) -> object:
        """--zoom REPORT / --zoom-* as a modes.zoom.ZoomTarget (None without them)."""
        from rl_msprobe.planner.modes.zoom import zoom_target

        return zoom_target(
            self.zoom, self.zoom_request, self.zoom_layer, self.zoom_module, self.zoom_position
        )


def list_lines(title: str, items: list[str]) -> list[str]:
    """`title:` and one `  - item` line each; nothing when there is no item."""
    return [f"{title}:", *(f"  - {item}" for item in items)] if items else []


def violation_lines(violations: list[dict[str, str]]) -> list[str]:
    """Each violation of a mode's rules (as in the JSON): what was found, what is required, the fix."""
    out = ["violations:"] if violations else []
    for v in violations:
        out.append(
            f"  - [{v['rule']}] {v['key']}: found {v['found'] or '-'}, required {v['required'] or '-'}"
        )
        out.append(f"      fix: {v['fix']}")
    return out


def changes_heading(mode: str) -> str:
    """The heading of prepare's list of changes: consistency keeps the job, so it says what differs."""
    if mode == "consistency":
        return "what differs from your job, and why (rule: the value it needs, and why)"
    return "changed (rule: the value it needs, and why)"


def msprobe_line(settings: dict[str, str]) -> str:
    """What every msprobe config written says about what is dumped (risk_level explained)."""
    risk = settings.get("risk_level", "")
    what = {
        "ALL": "every API call",
        "FOCUS": "low-risk calls (reshape, view, transpose, cat, to, ...) left out",
        "CORE": "only matmul / linear / norm / embedding / attention calls",
    }.get(risk, "")
    return (
        f"msprobe configs: level {settings.get('level')}, task {settings.get('task')}, "
        f"risk_level {risk} ({what}; --risk-level to change)"
    )


class Prepared(str, enum.Enum):
    """What `prepare` did: only WRITTEN (every rule met) exits 0."""

    WRITTEN = "written"
    UNMET = "written, rules unmet"  # the derived script still violates a rule of its mode
    REFUSED = "refused"  # nothing written: the script cannot be prepared for the mode
    MSPROBE_MISSING = "msprobe missing"  # nothing planned: msprobe does not import in --python


@dataclass(frozen=True)
class PrepareOutcome:
    """A `prepare` run: the plan (written, or refused), or why it stopped before planning."""

    path: str
    plan: Plan | None
    missing: MsprobeMissing | None = None

    @property
    def state(self) -> Prepared:
        if self.plan is None:
            return Prepared.MSPROBE_MISSING
        if self.plan.refused:
            return Prepared.REFUSED
        return Prepared.UNMET if self.plan.violations else Prepared.WRITTEN

    @property
    def ok(self) -> bool:
        return self.state is Prepared.WRITTEN

    def to_json(self) -> dict[str, Any]:
        inner = self.missing if self.plan is None else self.plan
        assert inner is not None  # one of the two, always
        return {"schema": PREPARE_SCHEMA, **inner.to_json()}

    def errors(self) -> list[str]:
        """What goes to stderr: why nothing was planned."""
        return [self.missing.message] if self.missing is not None else []

    def text(self) -> str:
        """What goes to stdout: the diff, what was written and what is left to do."""
        plan = self.plan
        if plan is None:
            return ""
        doc = plan.to_json()
        if plan.refused:
            head = f"Refused: {self.path} cannot be prepared for {plan.mode} collection.\n"
            body = violation_lines(doc["violations"])
        else:
            head = plan.diff
            body = list_lines(changes_heading(plan.mode), [c.line() for c in plan.changes])
            body.append(f"wrote {plan.derived_path}")
            body += [f"wrote {cfg}  ({role} msprobe config)" for role, cfg in doc["configs"].items()]
            body += [msprobe_line(plan.msprobe)] if doc["configs"] else []
            body += violation_lines(doc["violations"])
            todo = tree_variables(plan.patch_commands)
            todo += [f"apply the patches: {cmd}" for cmd in plan.patch_commands]
            if plan.patch_commands and not todo[: -len(plan.patch_commands)]:
                todo.append(
                    "patch the tree that actually runs (inside a container it may be /verl, not your checkout)"
                )
            todo.append(f"check: rl-msprobe check {shlex.quote(plan.derived_path)} --mode {plan.mode}")
            todo.append(f"run: bash {shlex.quote(plan.derived_path)}")
            body += list_lines("still to do", todo)
        body += list_lines("unverifiable", plan.unverifiable)
        body += list_lines("warnings", plan.warnings)
        body += list_lines("notes", plan.notes)
        return head + "".join(f"{line}\n" for line in body)


def prepare_script(options: PrepareOptions, argv: list[str] | None = None) -> PrepareOutcome:
    """Write a derived launch script and its msprobe configs for `options.script` (never touching it),
    all or nothing; a refused plan writes nothing. `argv`: the command line as given, for the
    derived script's "Regenerate with"."""
    from rl_msprobe.planner.prepare import MsprobeMissing, prepare

    text, path = read_script(options.script)
    result = prepare(
        options.request(text, path),
        options.trees,
        env_check=not options.no_env_check,
        force=options.force,
        argv=argv,
    )
    if isinstance(result, MsprobeMissing):
        return PrepareOutcome(path, None, result)
    return PrepareOutcome(path, result)


class Checked(str, enum.Enum):
    """What `check` found: HOLDS (every rule of the mode) exits 0, VIOLATED 1."""

    HOLDS = "holds"
    VIOLATED = "violated"


@dataclass(frozen=True)
class CheckOutcome:
    """A checked launch script: the planner's report, with the upstream trees' notes first."""

    path: str
    report: CheckReport

    @property
    def verdict(self) -> Checked:
        return Checked.HOLDS if self.report.result.ok else Checked.VIOLATED

    @property
    def ok(self) -> bool:
        return self.verdict is Checked.HOLDS

    def to_json(self) -> dict[str, Any]:
        return {"schema": CHECK_SCHEMA, **self.report.to_json()}

    def lines(self) -> list[str]:
        r = self.report
        status = "ok" if r.result.ok else f"{len(r.result.violations)} violation(s)"
        return [
            f"{self.path}: {r.mode} rules: {status}",
            *violation_lines([v.to_json() for v in r.result.violations]),
            *list_lines("patches this job needs", [*tree_variables(r.patch_commands), *r.patch_commands]),
            *list_lines("unverifiable", r.result.unverifiable),
            *list_lines("warnings", r.result.warnings),
            *list_lines("notes", r.notes),
        ]


def check_script(
    script: str,
    mode: str | None = None,
    backend: str | None = None,
    train_backend: str | None = None,
    hint: str | None = None,
    trees: tuple[str, ...] = (),
    python: str | None = None,
    command: int | None = None,
    batch_one: bool = False,
    model_config: str | None = None,
) -> CheckOutcome:
    """Check SCRIPT (derived or hand-written) against every rule of its collection mode (detected
    unless given), with the versions of the upstream trees named or imported by `python`."""
    from rl_msprobe import planner
    from rl_msprobe.planner.given_trees import resolve

    text, path = read_script(script)
    found = resolve(trees, python)
    report = planner.check(
        text,
        path,
        mode=mode,
        backend=backend,
        hint=hint,
        versions=found.versions,
        train_backend=train_backend,
        command=command,
        verl_root=found.roots.get("verl"),
        patch_target=found.where,
        vllm_root=found.roots.get("vllm"),
        batch_one=batch_one,
        python=python,
        model_config=model_config,
    )
    return CheckOutcome(path, dataclasses.replace(report, notes=[*found.notes, *report.notes]))


DETECT_SCHEMA = "rl-msprobe.detect/1"


@dataclass(frozen=True)
class DetectOutcome:
    """The collection mode, rollout engine and training backend decided for a script, and why."""

    detection: Detection

    @property
    def ok(self) -> bool:
        """The mode is decided (else the user chooses --mode)."""
        return self.detection.mode != "unknown"

    def to_json(self) -> dict[str, Any]:
        return {"schema": DETECT_SCHEMA, **self.detection.to_json()}

    def lines(self) -> list[str]:
        d = self.detection
        return [
            f"mode: {d.mode}",
            f"rollout: {d.rollout}",
            f"train_backend: {d.train_backend}",
            *list_lines("reasons", d.reasons),
        ]


def detect_script(
    script: str,
    hint: str | None = None,
    command: int | None = None,
    trees: tuple[str, ...] = (),
    python: str | None = None,
) -> DetectOutcome:
    """Decide SCRIPT's collection mode from its settings and `hint` (words, Chinese or English)."""
    from rl_msprobe import planner
    from rl_msprobe.planner.given_trees import resolve

    text, path = read_script(script)
    found = resolve(trees, python)
    _, detection = planner.detect_text(text, path, hint, command, found.roots.get("verl"))
    return DetectOutcome(detection)

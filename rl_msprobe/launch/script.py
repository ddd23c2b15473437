"""Find the verl command in a launch script read as bash.

`launch.bash` reads the shell (statements, variables, expansions); this module decides which
simple command runs verl (`python -m verl.trainer.main_ppo`, a recipe's main, a `main_*.py`
script), what kind of job it is, its arguments after expansion (with the words they come from,
so the planner can edit them in place) and the environment it runs with. A script may run
several verl commands: `choose_command` picks the one to prepare and says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rl_msprobe.errors import UserError
from rl_msprobe.launch import bash
from rl_msprobe.launch.bash import EnvSetting, Statement
from rl_msprobe.launch.bash_lexer import LineIndex, Word
from rl_msprobe.launch.bash_values import Scope, Value, Variable

VERL_ENTRY_RE = re.compile(
    r"^(?:verl\.trainer\.main_\w+|verl\.experimental\.[\w.]*main\w*|recipe\.[\w.]*main\w*|verl\.[\w.]*main_ppo"
    r"|verl\.trainer\.\w*sft_trainer\w*)$"
)
VERL_SCRIPT_RE = re.compile(r"(?:^|/)(?:main_ppo|fully_async_main|main_\w+|\w*sft_trainer\w*)\.py$")
# what kind of job an entry point runs: the collection modes apply to RL training jobs ("ppo")
# and, for inference only, to the rollout-server generation job
ENTRY_KINDS = (
    ("sft", re.compile(r"sft_trainer\w*(?:\.py)?$")),
    ("eval", re.compile(r"main_eval(?:\.py)?$")),
    ("generation_server", re.compile(r"main_generation_server(?:\.py)?$")),
    ("generation", re.compile(r"main_generation(?:\.py)?$")),
)


def entry_kind(entry: str) -> str:
    """`ppo` (a training job: main_ppo, fully-async, the recipes' mains), `generation_server`,
    `generation`, `eval` or `sft`."""
    for kind, pattern in ENTRY_KINDS:
        if pattern.search(entry):
            return kind
    return "ppo"


FULLY_ASYNC_RE = re.compile(r"fully_async")


@dataclass(frozen=True)
class Arg:
    """One argument of the verl command after expansion."""

    value: Value
    word: Word  # the source word it comes from (in the command or in an array assignment)
    editable: bool  # the word holds exactly this one argument, so it can be replaced in place
    origin: str  # "command", "array NAME" or "variable NAME"


@dataclass
class VerlCommand:
    statement: Statement
    entry: str  # module or script path
    fully_async: bool
    prefix_words: list[Word]  # python3 -m MODULE (and anything before)
    args: list[Arg]
    scope: Scope
    extra_args: bool  # "$@" or "$*" reaches the command
    env: list[EnvSetting]

    @property
    def last_word(self) -> Word:
        return self.statement.words[-1]

    @property
    def kind(self) -> str:
        return entry_kind(self.entry)


@dataclass
class LaunchScript:
    path: str
    text: str
    statements: list[Statement]
    command: VerlCommand | None
    other_commands: list[VerlCommand]
    variables: dict[str, Variable]
    notes: list[str]
    lines: LineIndex | None = None
    commands: list[VerlCommand] = field(default_factory=list)  # every verl command, in order
    choice_note: str | None = None

    def choose(self, number: int | None) -> None:
        """Select the verl command to work on (see `choose_command`); ValueError when out of range."""
        self.command, note = choose_command(self.commands, number)
        self.other_commands = [c for c in self.commands if c is not self.command]
        if self.choice_note in self.notes:
            self.notes.remove(self.choice_note)
        self.choice_note = note
        if note:
            self.notes.append(note)

    def line_of(self, pos: int) -> int:
        if self.lines is None:
            self.lines = LineIndex(self.text)
        return self.lines.line_of(pos)


def _is_python(value: str | None) -> bool:
    if value is None:
        return False
    base = value.rsplit("/", 1)[-1]
    return bool(re.fullmatch(r"python[\d.]*", base))


def _find_entry(values: list[Value]) -> tuple[int, str] | None:
    """Index of the last word that belongs to the entry (module after -m, or the .py script)."""
    for i, value in enumerate(values):
        text = value.text
        if text is None:
            continue
        module = values[i + 1].text if i + 1 < len(values) else None
        if text == "-m" and module and VERL_ENTRY_RE.match(module):
            return i + 1, module
        if (
            VERL_SCRIPT_RE.search(text)
            and i > 0
            and (_is_python(values[i - 1].text) or values[i - 1].text == "--")
        ):
            return i, text
        if VERL_SCRIPT_RE.search(text) and i == 0:
            return i, text
    return None


def parse_script(text: str, path: str = "<script>") -> LaunchScript:
    """Read a launch script and find its verl commands; raise ShellSyntaxError when the text is not
    valid shell."""
    reading = bash.read(text)
    commands: list[VerlCommand] = []
    notes: list[str] = []
    for stmt in bash.commands(reading):
        flat = bash.flatten(stmt, reading.scope)
        entry = _find_entry([v for v, *_ in flat])
        if entry is None:
            note = bash.sourced(stmt)
            if note is not None:
                notes.append(note)
            continue
        commands.append(_verl_command(stmt, reading.scope, flat, *entry))
        _refuse_escaped_space(text, path, stmt)
    script = LaunchScript(path, text, reading.statements, None, [], reading.scope.vars, notes, reading.lines)
    script.commands = commands
    script.choose(None)
    return script


def _refuse_escaped_space(text: str, path: str, stmt: Statement) -> None:
    """A verl command whose last line ends in a backslash and a space: bash reads `\\ ` as an escaped
    space, so the command ends there and the settings on the lines below never reach verl."""
    end = stmt.words[-1].end if stmt.words else 0
    line_end = text.find("\n", end)
    line = text[text.rfind("\n", 0, end) + 1 : len(text) if line_end < 0 else line_end]
    if re.search(r"\\[ \t]+\r?$", line) and text[end:].strip():
        number = text.count("\n", 0, end) + 1
        raise UserError(
            f"{path}:{number}: a backslash followed by a space ends the verl command here (bash reads `\\ ` as "
            "an escaped space, not a line continuation), so the lines below it never reach verl; delete the "
            "space after the backslash."
        )


def _verl_command(
    stmt: Statement, scope: Scope, flat: list[tuple[Value, Word, bool, str]], index: int, entry: str
) -> VerlCommand:
    """The verl command of a simple command whose words up to `flat[index]` are its entry point."""
    env, cmd_scope = bash.environment(stmt, scope)
    args = [Arg(v, w, editable, origin) for v, w, editable, origin in flat[index + 1 :]]
    extra = any(p.kind == "special" and p.text in "@*" for w in stmt.words for p in w.parts) or any(
        "$@" in r for a in args for r in a.value.runtime
    )
    return VerlCommand(
        statement=stmt,
        entry=entry,
        fully_async=bool(FULLY_ASYNC_RE.search(entry)),
        prefix_words=[w for w in stmt.words if w.end <= flat[index][1].end],
        args=args,
        scope=cmd_scope,
        extra_args=extra,
        env=env,
    )


_KIND_ORDER = ("ppo", "generation_server", "generation", "eval", "sft")
_KIND_WHY = {
    "ppo": "the training job",
    "generation_server": "the only generation job",
    "generation": "no training or rollout-server job",
    "eval": "no training or generation job",
    "sft": "no RL job",
}


def choose_command(commands: list[VerlCommand], number: int | None) -> tuple[VerlCommand | None, str | None]:
    """The command to prepare (1-based `number`, else the last training job) and a note saying why."""
    if not commands:
        return None, None
    lines = ", ".join(f"{i}: line {c.statement.line} {c.entry}" for i, c in enumerate(commands, 1))
    if number is not None:
        if not 1 <= number <= len(commands):
            raise ValueError(f"--command {number}: the script runs {len(commands)} verl command(s) ({lines})")
        chosen = commands[number - 1]
        why = "chosen with --command"
    else:
        kind = min((c.kind for c in commands), key=_KIND_ORDER.index)
        chosen = [c for c in commands if c.kind == kind][-1]
        why = f"the last {kind} command: {_KIND_WHY[kind]}" if len(commands) > 1 else ""
    if len(commands) == 1:
        return chosen, None
    return chosen, (
        f"{len(commands)} verl commands found ({lines}); using {commands.index(chosen) + 1} "
        f"(line {chosen.statement.line}, {chosen.entry}): {why}. Pass --command N to choose another."
    )

"""Read a bash launch script without running it: its statements, walked as bash would.

Three modules, one job each: `launch.bash_lexer` splits the text into words, operators and
array assignments (with their spans); `launch.bash_values` evaluates values statically, only
where that is sound (`Scope`); this module groups the tokens into statements (simple commands,
and the compound keywords `if`, `for`, `while`, `case` and functions, whose bodies make an
assignment depend on run time) and walks them.

Everything here is pure: `read(text)` gives the statements; `commands(reading)` walks them
as bash would, keeping the variables up to date, and hands over each simple command with the
scope it sees. Which of them is the verl command is `launch.script`'s business. The word spans
(`start`, `end`) let the planner edit the text precisely.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from rl_msprobe.launch.bash_lexer import (
    ASSIGN_RE,
    MAX_ARRAY_ITEMS,
    NAME_RE,
    REDIRECTS,
    SEPARATORS,
    TOO_COMPLEX,
    ArrayAssign,
    LineIndex,
    Op,
    Part,
    Token,
    Word,
    tokenize,
)
from rl_msprobe.launch.bash_values import Scope, Value, Variable, join_values

_COMPOUND_OPEN = {"if", "while", "until", "for", "case", "select", "{", "function"}
_COMPOUND_CLOSE = {"fi", "done", "esac", "}"}
_PREFIX_KEYWORDS = {"then", "do", "else", "elif", "!", "time"}
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}


@dataclass
class Statement:
    words: list[Word]
    arrays: list[ArrayAssign]
    assignments: list[Word]
    start: int
    end: int
    depth: int
    line: int
    keyword: str | None = None


def _split_statements(lines: LineIndex, tokens: list[Token]) -> list[Statement]:
    statements: list[Statement] = []
    depth = 0
    current: list[Token] = []
    line_of = lines.line_of

    def close() -> None:
        nonlocal depth
        if not current:
            return
        toks = list(current)
        current.clear()
        keyword = None
        # leading keywords
        while (
            toks and isinstance(toks[0], Word) and toks[0].literal() in (_PREFIX_KEYWORDS | _COMPOUND_CLOSE)
        ):
            lit = toks[0].literal()
            if lit in _COMPOUND_CLOSE:
                depth = max(0, depth - 1)
            toks.pop(0)
        if toks and isinstance(toks[0], Word) and toks[0].literal() in _COMPOUND_OPEN:
            keyword = toks[0].literal()
            depth += 1
            if keyword == "{":
                toks.pop(0)
                keyword = None
        # a function definition `name() {` arrives as words [name] then ( ) handled by the caller
        words: list[Word] = []
        arrays: list[ArrayAssign] = []
        assignments: list[Word] = []
        skip_next = False
        in_prefix = True
        for tok in toks:
            if isinstance(tok, Op):
                if tok.text in REDIRECTS:
                    skip_next = True
                continue
            if skip_next:
                skip_next = False
                continue
            if isinstance(tok, ArrayAssign):
                arrays.append(tok)
                continue
            if in_prefix and keyword is None and ASSIGN_RE.match(tok.unquoted_prefix):
                assignments.append(tok)
                continue
            in_prefix = False
            words.append(tok)
        # trailing closers on the same line (`fi`, `done`, `}`)
        while words and words[-1].literal() in _COMPOUND_CLOSE and keyword is None and len(words) == 1:
            depth = max(0, depth - 1)
            words.pop()
        start = toks[0].start if toks else 0
        end = toks[-1].end if toks else 0
        if words or arrays or assignments or keyword:
            stmt_depth = depth - 1 if keyword else depth
            statements.append(
                Statement(words, arrays, assignments, start, end, stmt_depth, line_of(start), keyword)
            )

    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if isinstance(tok, Op) and tok.text in SEPARATORS:
            if tok.text == "(":
                nxt = tokens[i + 1] if i + 1 < len(tokens) else None
                if isinstance(nxt, Op) and nxt.text == ")" and current:
                    # function definition: NAME ( ) { ...
                    current.clear()
                    depth += 1
                    i += 2
                    after = tokens[i] if i < len(tokens) else None
                    if isinstance(after, Word) and after.literal() == "{":
                        i += 1
                    continue
                close()
                depth += 1
            elif tok.text == ")":
                close()
                depth = max(0, depth - 1)
            else:
                close()
            i += 1
            continue
        current.append(tok)
        i += 1
    close()
    return statements


@dataclass(frozen=True)
class EnvSetting:
    name: str
    value: Value
    how: str  # "export", "command prefix"
    line: int


@dataclass
class Reading:
    """A script read as bash: its statements, and the variables as the walk has left them."""

    lines: LineIndex
    statements: list[Statement]
    scope: Scope = field(default_factory=Scope)


def read(text: str) -> Reading:
    """Split a script into statements; raise ShellSyntaxError when the text is not valid shell."""
    tokens = tokenize(text)
    lines = LineIndex(text)
    return Reading(lines, _split_statements(lines, tokens))


def commands(reading: Reading) -> Iterator[Statement]:
    """Walk the statements in order and yield each simple command; meanwhile `reading.scope`
    follows the assignments, exports, `unset`s and loop variables, so at each yield it holds
    the variables as bash would have them at that line."""
    scope, lines = reading.scope, reading.lines
    for stmt in reading.statements:
        conditional = stmt.depth > 0 or stmt.keyword is not None
        if stmt.keyword == "for" and len(stmt.words) > 1 and stmt.words[1].literal():
            name = stmt.words[1].literal() or ""
            scope.vars[name] = Variable(
                name, Value(None, (f"${name} is a loop variable",)), None, False, stmt.line, True
            )
        first = stmt.words[0].literal() if stmt.words else None
        declared_export = first == "export" or (
            first in ("declare", "typeset")
            and any(
                (w.literal() or "").startswith("-") and "x" in (w.literal() or "") for w in stmt.words[1:2]
            )
        )
        if first in _DECLARE:
            pending = [w for w in stmt.words[1:] if not (w.literal() or "").startswith("-")]
            targets = [w for w in pending if ASSIGN_RE.match(w.unquoted_prefix)]
            for w in pending:
                lit = w.literal()
                if lit and NAME_RE.fullmatch(lit):
                    if lit in scope.vars:
                        scope.vars[lit].exported = scope.vars[lit].exported or declared_export
                    elif declared_export:
                        # `export X` of an environment variable: still from the environment
                        pass
            for w in targets:
                _assign(scope, w, conditional, declared_export, lines)
            for arr in stmt.arrays:
                _assign_array(scope, arr, conditional, lines)
            continue
        if first == "unset":
            for w in stmt.words[1:]:
                lit = w.literal()
                if lit and lit in scope.vars:
                    del scope.vars[lit]
            continue
        if not stmt.words:
            for w in stmt.assignments:
                _assign(scope, w, conditional, False, lines)
            for arr in stmt.arrays:
                _assign_array(scope, arr, conditional, lines)
            continue
        yield stmt


def sourced(stmt: Statement) -> str | None:
    """The note for `source FILE` / `. FILE`: variables this reader cannot see."""
    first = stmt.words[0].literal() if stmt.words else None
    if first in ("source", ".") and len(stmt.words) > 1:
        return f"line {stmt.line}: `{stmt.words[0].raw} {stmt.words[1].raw}` may set variables this reader cannot see."
    return None


def environment(stmt: Statement, scope: Scope) -> tuple[list[EnvSetting], Scope]:
    """What a simple command runs with: its prefix assignments, then every exported variable; and
    the scope its words see (a copy, so a `${X:=...}` in a prefix does not leak into the script)."""
    cmd_scope = scope.copy()
    env: list[EnvSetting] = []
    for w in stmt.assignments:
        assignment = ASSIGN_RE.match(w.unquoted_prefix)
        assert assignment is not None, "stmt.assignments holds the words that are assignments"
        name = assignment.group(1)
        value = _assignment_value(cmd_scope, w)
        env.append(EnvSetting(name, value, "command prefix", stmt.line))
    for name, var in scope.vars.items():
        if var.exported:
            env.append(
                EnvSetting(
                    name,
                    var.value if not var.conditional else cmd_scope.lookup(name)[0],
                    "export",
                    var.line,
                )
            )
    return env, cmd_scope


def flatten(stmt: Statement, scope: Scope) -> list[tuple[Value, Word, bool, str]]:
    """Expand the command words, following array and variable expansions to their source words."""
    out: list[tuple[Value, Word, bool, str]] = []
    for word in stmt.words:
        if len(word.parts) == 1 and word.parts[0].kind == "param":
            body = word.parts[0].text
            match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]", body)
            name = match.group(1) if match else (body if NAME_RE.fullmatch(body) else None)
            var = scope.vars.get(name) if name else None
            if var is not None and not var.conditional and var.items is not None and match:
                items = list(var.items)
                sources = var.item_words
                for index, value in enumerate(items):
                    src = sources[index] if index < len(sources) else word
                    if (
                        not word.parts[0].quoted
                        and value.text is not None
                        and value.text.split() != [value.text]
                    ):
                        for piece in value.text.split():
                            out.append((Value(piece, (), value.assumed), src, False, f"array {name}"))
                    else:
                        out.append((value, src, index < len(sources), f"array {name}"))
                continue
            if var is not None and var.items is None and not word.parts[0].quoted:
                values = scope.expand(word)
                for value in values:
                    out.append((value, word, False, f"variable {name}"))
                continue
        values = scope.expand(word)
        for value in values:
            out.append((value, word, len(values) == 1, "command"))
    return out


def _assignment_value(scope: Scope, word: Word) -> Value:
    prefix = ASSIGN_RE.match(word.unquoted_prefix)
    assert prefix is not None
    cut = len(prefix.group(0))
    parts: list[Part] = []
    consumed = 0
    for part in word.parts:
        if consumed >= cut:
            parts.append(part)
            continue
        if part.kind == "lit" and not part.quoted:
            remaining = cut - consumed
            if len(part.text) > remaining:
                parts.append(Part("lit", part.text[remaining:], False))
            consumed += min(len(part.text), remaining)
    values = scope.expand(Word(tuple(parts), word.start + cut, word.end, word.raw[cut:]), split=False)
    return join_values(values, " ") if values else Value("")


def _assign(scope: Scope, word: Word, conditional: bool, exported: bool, lines: LineIndex) -> None:
    match = ASSIGN_RE.match(word.unquoted_prefix)
    assert match is not None
    name, append = match.group(1), match.group(2) == "+"
    value = _assignment_value(scope, word)
    line = lines.line_of(word.start)
    old = scope.vars.get(name)
    if append and old is not None:
        value = join_values([old.value, value], "")
    var = Variable(
        name,
        value,
        None,
        exported or (old.exported if old else False),
        line,
        conditional or (old.conditional if (old and append) else False),
        [*(old.assignments if old else []), (word.start + len(match.group(0)), word.end, line)],
    )
    scope.vars[name] = var


def _assign_array(scope: Scope, arr: ArrayAssign, conditional: bool, lines: LineIndex) -> None:
    values: list[Value] = []
    words: list[Word] = []
    for item in arr.items:
        expanded = scope.expand(item)
        values.extend(expanded)
        # an item that expands to exactly one value can be edited in place
        words.extend([item] if len(expanded) == 1 else [])
        if len(expanded) != 1:
            words = []  # positions no longer line up: nothing of this array is editable
    old = scope.vars.get(arr.name)
    old_words: list[Word] = old.item_words if old else []
    line = lines.line_of(arr.start)
    if arr.append and conditional and old is not None and old.items is not None and not old.conditional:
        # `ARR+=( ... )` inside `if`: the items before stay certain; the appended ones may or may not
        # be there at run time, so they are reported as run-time values, never guessed
        why = f"{arr.name}+=( ... ) on line {line} is inside a conditional block; whether it runs depends on run time"
        values = [Value(None, (why,), v.assumed) for v in values]
        conditional = False
    if arr.append and old is not None and old.items is not None:
        lined_up = len(old_words) == len(old.items)
        values = [*old.items, *values]
        words = [*old_words, *words] if lined_up and len(words) == len(arr.items) else []
    if len(values) > MAX_ARRAY_ITEMS:
        why = f"{arr.name} on line {line}: {TOO_COMPLEX} (an array of more than {MAX_ARRAY_ITEMS:,} items)"
        values, words = [Value(None, (why,))], []
    scope.vars[arr.name] = Variable(
        arr.name,
        join_values(values[:1], ""),
        values,
        old.exported if old else False,
        line,
        conditional,
        item_words=words if len(words) == len(values) else [],
    )

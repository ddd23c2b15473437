"""Read a bash launch script without running it.

A small bash lexer for what verl launch scripts actually contain: backslash-continued
lines, single / double / ANSI-C quoting, comments, `export`, plain and array assignments
(`ARGS=( ... )`, `ARGS+=( ... )`), parameter expansions (`$X`, `${X}`, `${X:-def}`,
`${X:=def}`, `"${ARR[@]}"`), `$((...))` arithmetic, `$(...)` / backticks, `$@`, redirections,
and the compound keywords (`if`, `for`, `while`, `case`, functions) whose bodies make an
assignment depend on run time.

Variables are resolved statically only where that is sound: a value that depends on run
time (an environment variable the script never sets, a command substitution, a positional
argument, an assignment inside a conditional block) is reported with its reason, never
guessed. `${X:-default}` resolves to the default when the script never sets X, and says that
the environment may override it.

Everything here is pure: `read(text)` gives the statements; `commands(reading)` walks them
as bash would, keeping the variables up to date, and hands over each simple command with the
scope it sees. Which of them is the verl command is `launch.script`'s business. The word spans
(`start`, `end`) let the planner edit the text precisely.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")

# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Part:
    """One piece of a shell word.

    kind: `lit` (literal text), `param` (`$X`, `${...}`: `text` is the inside of the braces
    or the name), `arith` (`$((text))`), `cmd` (`$(text)` or backticks), `special` (`$@`,
    `$1`, `$#`, ...).
    """

    kind: str
    text: str
    quoted: bool


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    start: int
    end: int
    raw: str

    def literal(self) -> str | None:
        """The word's text when it has no expansions at all."""
        if all(p.kind == "lit" for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None

    @property
    def unquoted_prefix(self) -> str:
        """Leading unquoted literal text (for recognising `NAME=`)."""
        out = []
        for part in self.parts:
            if part.kind != "lit" or part.quoted:
                break
            out.append(part.text)
        return "".join(out)


@dataclass(frozen=True)
class ArrayAssign:
    """`NAME=( items )` or `NAME+=( items )`."""

    name: str
    append: bool
    items: tuple[Word, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Op:
    text: str
    start: int
    end: int


Token = Word | ArrayAssign | Op

_SEPARATORS = {";", "\n", "&&", "||", "|", "&", ";;", "|&", "(", ")"}
_REDIRECTS = {">", ">>", "<", "<<", "<<<", ">&", "<&", "&>", "&>>", ">|", "<>"}


class LineIndex:
    """Line numbers by binary search over the newline offsets (found once): O(log n) per query."""

    def __init__(self, text: str):
        self.newlines = [m.start() for m in re.finditer("\n", text)]

    def line_of(self, pos: int) -> int:
        return bisect.bisect_left(self.newlines, pos) + 1


_PLAIN_RUN = re.compile(r"[^ \t\r\n;&|()<>\\'\"$`]+")  # word characters with no special meaning
_DQ_RUN = re.compile(r'[^"\\$`]+')  # inside double quotes
_BLANKS = re.compile(r"[ \t\r]+")
_PAREN_RUN = re.compile(r"[^\\'\"()]+")
_BRACE_RUN = re.compile(r"[^\\'{}]+")
MAX_NESTING = 32  # `${A:-${A:-...}}` deeper than this is reported as too complex
MAX_ARITH_BITS = 4096  # bash works in 64-bit integers; far larger intermediate values are refused
MAX_ARITH_CHARS = 10_000
MAX_VALUE_CHARS = (
    1 << 22
)  # 4 Mi characters: a value a script doubles in a loop stops here, not at MemoryError
MAX_ARRAY_ITEMS = 1 << 16  # 65,536 items: likewise for an array appended to itself
TOO_COMPLEX = "too complex to evaluate; reported as unverifiable"


def _continuation(text: str, pos: int) -> int:
    """Length of a line continuation at pos (a backslash at text[pos]), 0 when it is an escape.

    `\\` + newline, `\\` + CRLF (a script saved with Windows line ends reads as its author
    meant it), and a backslash that ends the file (bash drops it).
    """
    if text.startswith("\\\n", pos):
        return 2
    if text.startswith("\\\r\n", pos):
        return 3
    return 1 if pos == len(text) - 1 else 0


class ShellSyntaxError(ValueError):
    def __init__(self, message: str, line: int):
        super().__init__(f"line {line}: {message}")
        self.line = line


class _Lexer:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.tokens: list[Token] = []
        self.heredocs: list[tuple[str, bool]] = []
        self._lines: LineIndex | None = None

    def line_of(self, pos: int) -> int:
        if self._lines is None:
            self._lines = LineIndex(self.text)
        return self._lines.line_of(pos)

    def error(self, message: str, pos: int) -> ShellSyntaxError:
        return ShellSyntaxError(message, self.line_of(pos))

    def run(self) -> list[Token]:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r":
                blanks = _BLANKS.match(text, self.pos)
                assert blanks is not None, "text[pos] is a blank"
                self.pos = blanks.end()
            elif c == "\\" and _continuation(text, self.pos):
                self.pos += _continuation(text, self.pos)
            elif c == "\n":
                self.tokens.append(Op("\n", self.pos, self.pos + 1))
                self.pos += 1
                if self.heredocs:
                    self._skip_heredocs()
            elif c == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif c in ";&|()<>":
                self._operator()
            else:
                self._word_or_array()
        return self.tokens

    def _operator(self) -> None:
        text, start = self.text, self.pos
        for op in ("&>>", "<<<", ";;", "&&", "||", "|&", ">>", "<<", ">&", "<&", "&>", ">|", "<>"):
            if text.startswith(op, start):
                break
        else:
            op = text[start]
        self.pos += len(op)
        if op in ("<(", ">("):  # pragma: no cover - handled below
            pass
        if op in ("<", ">") and self.pos < len(text) and text[self.pos] == "(":
            # process substitution: treat as one runtime word
            end = self._match_paren(self.pos + 1)
            word = Word(
                (Part("cmd", text[self.pos + 1 : end], False),), start, end + 1, text[start : end + 1]
            )
            self.pos = end + 1
            self.tokens.append(word)
            return
        if op == "<<":
            self._register_heredoc()
        self.tokens.append(Op(op, start, self.pos))

    def _register_heredoc(self) -> None:
        text = self.text
        pos = self.pos
        strip = False
        if pos < len(text) and text[pos] == "-":
            strip = True
            pos += 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        match = re.match(r"""(['"]?)([A-Za-z0-9_]+)\1""", text[pos:])
        if match:
            self.heredocs.append((match.group(2), strip))

    def _skip_heredocs(self) -> None:
        for delimiter, strip in self.heredocs:
            while self.pos < len(self.text):
                end = self.text.find("\n", self.pos)
                end = len(self.text) if end < 0 else end
                line = self.text[self.pos : end]
                self.pos = min(end + 1, len(self.text))
                if (line.lstrip("\t") if strip else line) == delimiter:
                    break
        self.heredocs = []

    def _word_or_array(self) -> None:
        start = self.pos
        word = self._word()
        text = self.text
        match = _ASSIGN_RE.match(word.unquoted_prefix)
        if match and word.raw == match.group(0) and self.pos < len(text) and text[self.pos] == "(":
            self.pos += 1
            items: list[Word] = []
            while True:
                while self.pos < len(text) and (
                    text[self.pos] in " \t\r\n" or (text[self.pos] == "\\" and _continuation(text, self.pos))
                ):
                    self.pos += _continuation(text, self.pos) if text[self.pos] == "\\" else 1
                if self.pos >= len(text):
                    raise self.error("array assignment is not closed with `)`", start)
                c = text[self.pos]
                if c == ")":
                    self.pos += 1
                    break
                if c == "#":
                    end = text.find("\n", self.pos)
                    self.pos = len(text) if end < 0 else end
                    continue
                items.append(self._word())
            self.tokens.append(
                ArrayAssign(match.group(1), match.group(2) == "+", tuple(items), start, self.pos)
            )
            return
        self.tokens.append(word)

    def _word(self) -> Word:
        text = self.text
        start = self.pos
        parts: list[Part] = []
        buf: list[str] = []

        def flush(quoted: bool) -> None:
            if buf:
                parts.append(Part("lit", "".join(buf), quoted))
                buf.clear()

        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r\n;&|()<>":
                digits = "".join(buf)
                if c in "<>" and not parts and buf and digits.isascii() and digits.isdigit():
                    # `2>` file-descriptor redirection: the digits belong to the operator
                    self.pos = start
                    self._fd_redirect()
                    return Word((), start, start, "")
                break
            if c == "\\":
                if _continuation(text, self.pos):
                    self.pos += _continuation(text, self.pos)
                    continue
                flush(False)
                if self.pos + 1 < len(text):
                    parts.append(Part("lit", text[self.pos + 1], True))
                self.pos += 2
                continue
            if c == "'":
                flush(False)
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.error("unterminated single quote", self.pos)
                parts.append(Part("lit", text[self.pos + 1 : end], True))
                self.pos = end + 1
                continue
            if c == '"':
                flush(False)
                self._double_quoted(parts)
                continue
            if c == "$":
                flush(False)
                self._dollar(parts, quoted=False)
                continue
            if c == "`":
                flush(False)
                end = self._backtick_end(self.pos)
                parts.append(Part("cmd", text[self.pos + 1 : end], False))
                self.pos = end + 1
                continue
            run = _PLAIN_RUN.match(text, self.pos)
            if run is None:  # pragma: no cover - every other character is handled above
                buf.append(c)
                self.pos += 1
                continue
            buf.append(run.group(0))
            self.pos = run.end()
        flush(False)
        return Word(tuple(parts), start, self.pos, text[start : self.pos])

    def _fd_redirect(self) -> None:
        match = re.compile(r"\d+(>>|>&|<&|>|<)").match(self.text, self.pos)
        assert match is not None
        self.tokens.append(Op(match.group(1), match.start(), match.end()))
        self.pos = match.end()

    def _double_quoted(self, parts: list[Part]) -> None:
        text = self.text
        open_pos = self.pos
        self.pos += 1
        buf: list[str] = []
        count = len(parts)
        while True:
            if self.pos >= len(text):
                raise self.error("unterminated double quote", open_pos)
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                break
            if c == "\\" and self.pos + 1 < len(text):
                nxt = text[self.pos + 1]
                if nxt == "\n" or text.startswith("\r\n", self.pos + 1):
                    self.pos += 2 if nxt == "\n" else 3
                    continue
                if nxt in '"\\$`':
                    buf.append(nxt)
                    self.pos += 2
                    continue
                buf.append(c)
                self.pos += 1
                continue
            if c == "$":
                if buf:
                    parts.append(Part("lit", "".join(buf), True))
                    buf = []
                self._dollar(parts, quoted=True)
                continue
            if c == "`":
                if buf:
                    parts.append(Part("lit", "".join(buf), True))
                    buf = []
                end = self._backtick_end(self.pos)
                parts.append(Part("cmd", text[self.pos + 1 : end], True))
                self.pos = end + 1
                continue
            run = _DQ_RUN.match(text, self.pos)
            if run is None:  # pragma: no cover
                buf.append(c)
                self.pos += 1
                continue
            buf.append(run.group(0))
            self.pos = run.end()
        # an empty "" still yields a (quoted, empty) part so the word exists
        if buf or len(parts) == count:
            parts.append(Part("lit", "".join(buf), True))

    def _backtick_end(self, pos: int) -> int:
        text = self.text
        i = pos + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == "`":
                return i
            i += 1
        raise self.error("unterminated backtick", pos)

    def _match_paren(self, pos: int) -> int:
        """Index of the `)` closing a `(` just before pos (quotes respected)."""
        text = self.text
        depth = 1
        i = pos
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "'":
                end = text.find("'", i + 1)
                i = len(text) if end < 0 else end + 1
                continue
            if c == '"':
                i += 1
                while i < len(text) and text[i] != '"':
                    if text[i] == "\\":
                        i += 2
                        continue
                    run = _DQ_RUN.match(text, i)
                    i = run.end() if run else i + 1
                i += 1
                continue
            run = _PAREN_RUN.match(text, i)
            if run is not None:
                i = run.end()
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return i
            i += 1
        raise self.error("unbalanced parentheses", pos)

    def _dollar(self, parts: list[Part], quoted: bool) -> None:
        text = self.text
        pos = self.pos
        nxt = text[pos + 1] if pos + 1 < len(text) else ""
        if text.startswith("$((", pos):
            end = self._match_paren(pos + 3)
            # `$((expr))`: end is the first `)` of `))`; otherwise `$( (subshell) ...)`
            if not text.startswith("))", end):
                end2 = self._match_paren(pos + 2)
                parts.append(Part("cmd", text[pos + 2 : end2], quoted))
                self.pos = end2 + 1
                return
            parts.append(Part("arith", text[pos + 3 : end], quoted))
            self.pos = end + 2
            return
        if nxt == "(":
            end = self._match_paren(pos + 2)
            parts.append(Part("cmd", text[pos + 2 : end], quoted))
            self.pos = end + 1
            return
        if nxt == "{":
            depth = 1
            i = pos + 2
            while i < len(text) and depth:
                c = text[i]
                if c == "\\":
                    i += 2
                    continue
                if c == "'" and not quoted:
                    end = text.find("'", i + 1)
                    i = len(text) if end < 0 else end + 1
                    continue
                run = _BRACE_RUN.match(text, i)
                if run is not None:
                    i = run.end()
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                i += 1
            if depth:
                raise self.error("unterminated ${...}", pos)
            parts.append(Part("param", text[pos + 2 : i - 1], quoted))
            self.pos = i
            return
        if nxt == "'" and not quoted:
            i = pos + 2
            buf: list[str] = []
            escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "r": "\r", "0": "\0"}
            while i < len(text) and text[i] != "'":
                if text[i] == "\\" and i + 1 < len(text):
                    buf.append(escapes.get(text[i + 1], "\\" + text[i + 1]))
                    i += 2
                    continue
                buf.append(text[i])
                i += 1
            if i >= len(text):
                raise self.error("unterminated $'...'", pos)
            parts.append(Part("lit", "".join(buf), True))
            self.pos = i + 1
            return
        match = NAME_RE.match(text, pos + 1)
        if match:
            parts.append(Part("param", match.group(0), quoted))
            self.pos = match.end()
            return
        if nxt and nxt in "@*#?$!-0123456789":
            parts.append(Part("special", nxt, quoted))
            self.pos = pos + 2
            return
        parts.append(Part("lit", "$", quoted))
        self.pos = pos + 1


def tokenize(text: str) -> list[Token]:
    return [t for t in _Lexer(text).run() if not (isinstance(t, Word) and not t.parts and t.start == t.end)]


# ---------------------------------------------------------------- values


@dataclass(frozen=True)
class Value:
    """A statically evaluated shell value: `text` when known, else the reason it is not."""

    text: str | None
    runtime: tuple[str, ...] = ()  # why it depends on run time (empty when known)
    assumed: tuple[str, ...] = ()  # defaults taken (`${X:-16}`), which the environment may change

    @property
    def known(self) -> bool:
        return self.text is not None


@dataclass
class Variable:
    name: str
    value: Value
    items: list[Value] | None  # arrays
    exported: bool
    line: int
    conditional: bool
    assignments: list[tuple[int, int, int]] = field(
        default_factory=list
    )  # (start, end, line) of each value word
    item_words: list[Word] = field(
        default_factory=list
    )  # arrays: the source word of each item, when they line up


class _Arith:
    OPS = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.LShift: operator.lshift,
        ast.RShift: operator.rshift,
    }

    @classmethod
    def evaluate(cls, expr: str) -> int:
        expr = expr.replace("/", "//").replace("****", "**")
        node = ast.parse(expr.strip() or "0", mode="eval").body
        return cls._eval(node)

    @classmethod
    def _eval(cls, node: ast.AST) -> int:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = cls._eval(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in cls.OPS:
            left, right = cls._eval(node.left), cls._eval(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            if isinstance(node.op, ast.FloorDiv):  # bash truncates toward zero
                return int(left / right) if (left < 0) ^ (right < 0) else left // right
            if isinstance(node.op, ast.Pow) and (right < 0 or right > 64):
                raise ValueError("exponent out of range")
            if isinstance(node.op, ast.Pow) and max(abs(left), 1).bit_length() * right > MAX_ARITH_BITS:
                raise ValueError(TOO_COMPLEX)
            if isinstance(node.op, ast.LShift) and right > MAX_ARITH_BITS:
                raise ValueError(TOO_COMPLEX)
            if isinstance(node.op, ast.LShift | ast.RShift) and right < 0:
                raise ValueError("negative shift count")
            result: int = cls.OPS[type(node.op)](left, right)
            return result
        raise ValueError("not plain integer arithmetic")


class Scope:
    """Variables as the script has set them up to some point."""

    def __init__(self) -> None:
        self.vars: dict[str, Variable] = {}
        self._nesting = 0  # `${X:-${Y:-...}}` defaults being evaluated, innermost last

    def copy(self) -> Scope:
        new = Scope()
        new.vars = {k: dataclasses.replace(v) for k, v in self.vars.items()}
        return new

    # -- evaluation

    def lookup(self, name: str) -> tuple[Value, Variable | None]:
        var = self.vars.get(name)
        if var is None and name.isdigit():
            return Value(None, (f"${name} is an argument given to the script at run time",)), None
        if var is None:
            return Value(
                None, (f"${name} is not set in the script; its value comes from the environment at run time",)
            ), None
        if var.conditional:
            return (
                Value(
                    None,
                    (
                        f"${name} is assigned inside a conditional block (line {var.line}); its value depends on run time",
                    ),
                ),
                var,
            )
        if var.items is not None:
            return (var.items[0] if var.items else Value("")), var
        return var.value, var

    def param(self, body: str) -> list[Value]:
        """Evaluate the inside of `${...}` (or a bare name); arrays give several values."""
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[([@*])\]", body)
        if match:
            var = self.vars.get(match.group(1))
            if var is None or var.conditional:
                value, _ = self.lookup(match.group(1))
                return [value]
            items = var.items if var.items is not None else [var.value]
            if match.group(2) == "*":
                return [_join(items, " ")]
            return list(items)
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[(\d+)\]", body)
        if match:
            var = self.vars.get(match.group(1))
            if var is None or var.conditional:
                return [self.lookup(match.group(1))[0]]
            items = var.items if var.items is not None else [var.value]
            index = int(match.group(2))
            return [items[index] if index < len(items) else Value("")]
        match = re.fullmatch(r"#([A-Za-z_][A-Za-z0-9_]*)(\[[@*]\])?", body)
        if match:
            var = self.vars.get(match.group(1))
            if var is None or var.conditional:
                return [Value(None, self.lookup(match.group(1))[0].runtime)]
            if match.group(2):
                return [Value(str(len(var.items if var.items is not None else [var.value])))]
            value = var.value if var.items is None else (var.items[0] if var.items else Value(""))
            return [Value(str(len(value.text)))] if value.text is not None else [value]
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(:?[-=+?])(.*)", body, re.S)
        if match:
            name, op, arg = match.groups()
            value, var = self.lookup(name)
            if var is None:
                if op in (":-", "-", ":=", "="):
                    default = self.evaluate_text(arg)
                    return [
                        Value(
                            default.text,
                            default.runtime,
                            (
                                *default.assumed,
                                f"${{{name}:-...}} uses the script's default "
                                f"{repr(default.text) if default.known else '(itself known only at run time)'}; "
                                + (
                                    f"an argument given to the script would change it (${name} is positional)"
                                    if name.isdigit()
                                    else f"an exported {name} would change it"
                                ),
                            ),
                        )
                    ]
                if op in (":+", "+"):
                    return [
                        Value(None, (f"${{{body}}} depends on whether {name} is set in the environment",))
                    ]
                return [Value(None, value.runtime)]
            if not value.known:
                return [value]
            empty = value.text == ""
            if op in (":-", ":="):
                return [self.evaluate_text(arg)] if empty else [value]
            if op in ("-", "="):
                return [value]
            if op == ":+":
                return [Value("")] if empty else [self.evaluate_text(arg)]
            if op == "+":
                return [self.evaluate_text(arg)]
            return [value]
        if NAME_RE.fullmatch(body):
            return [self.lookup(body)[0]]
        return [Value(None, (f"${{{body}}} is an expansion this reader does not evaluate",))]

    def evaluate_text(self, text: str) -> Value:
        """Evaluate a word given as text (a `${X:-default}` default, an arithmetic operand)."""
        if self._nesting >= MAX_NESTING:
            return Value(None, (f"{TOO_COMPLEX} (expansions nested deeper than {MAX_NESTING})",))
        self._nesting += 1
        try:
            return self._evaluate_text(text)
        finally:
            self._nesting -= 1

    def _evaluate_text(self, text: str) -> Value:
        try:
            lexer = _Lexer(text)
            lexer.pos = 0
            parts: list[Part] = []
            while lexer.pos < len(text):
                word = lexer._word()
                parts.extend(word.parts)
                if lexer.pos < len(text):
                    parts.append(Part("lit", text[lexer.pos], True))
                    lexer.pos += 1
        except ShellSyntaxError as exc:
            return Value(None, (f"cannot read {text!r}: {exc}",))
        values = self.expand(Word(tuple(parts), 0, len(text), text), split=False)
        return _join(values, " ")

    def arith(self, expr: str) -> Value:
        runtime: list[str] = []
        assumed: list[str] = []

        def substitute(match: re.Match[str]) -> str:
            body = match.group(1) or match.group(2) or match.group(3)
            value = self.param(body)[0] if match.group(1) or match.group(2) else self.lookup(body)[0]
            runtime.extend(value.runtime)
            assumed.extend(value.assumed)
            text = value.text or "0"
            return f"({text.strip() or '0'})"

        replaced = re.sub(
            r"\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\b([A-Za-z_][A-Za-z0-9_]*)\b", substitute, expr
        )
        if runtime:
            return Value(None, tuple(runtime))
        shown = expr if len(expr) <= 80 else expr[:77] + "..."
        if len(replaced) > MAX_ARITH_CHARS:
            return Value(None, (f"$(({shown})): {TOO_COMPLEX} (longer than {MAX_ARITH_CHARS} characters)",))
        try:
            # substituted values may themselves be expressions (`X=$((A*2))` gives digits anyway)
            return Value(str(_Arith.evaluate(replaced)), (), tuple(assumed))
        except (RecursionError, MemoryError):
            return Value(None, (f"$(({shown})): {TOO_COMPLEX}",))
        except (ValueError, SyntaxError, TypeError, OverflowError) as exc:
            return Value(None, (f"$(({shown})) is not arithmetic this reader can evaluate ({exc})",))

    def expand(self, word: Word, split: bool = True) -> list[Value]:
        """Expand one word to the values it becomes (arrays and unquoted splitting give several)."""
        fields: list[list[Value]] = [[]]
        for part in word.parts:
            if part.kind == "lit":
                fields[-1].append(Value(part.text))
            elif part.kind == "special":
                if part.text in "@*":
                    fields[-1].append(Value(None, ("$@: the arguments given to the script at run time",)))
                else:
                    fields[-1].append(Value(None, (f"${part.text} is only known at run time",)))
            elif part.kind == "cmd":
                fields[-1].append(Value(None, (f"$({part.text.strip()}) is a command run at run time",)))
            elif part.kind == "arith":
                fields[-1].append(self.arith(part.text))
            else:  # param
                values = self.param(part.text)
                if not part.quoted and split:
                    pieces: list[Value] = []
                    for value in values:
                        if value.text is not None and value.text.split() != [value.text]:
                            pieces.extend(Value(t, (), value.assumed) for t in value.text.split())
                        else:
                            pieces.append(value)
                    values = pieces
                if len(values) == 1:
                    fields[-1].append(values[0])
                elif not values:
                    if not any(p.quoted for p in word.parts) and len(word.parts) == 1:
                        return []
                else:
                    fields[-1].append(values[0])
                    for value in values[1:]:
                        fields.append([value])
        return [_join(f, "") for f in fields]


def _join(values: list[Value], sep: str) -> Value:
    if len(values) == 1 and not values[0].runtime:
        return values[0]
    runtime = tuple(dict.fromkeys(r for v in values for r in v.runtime))  # doubled by `S="$S$S"`: once each
    assumed = tuple(dict.fromkeys(a for v in values for a in v.assumed))
    if runtime:
        return Value(None, runtime, assumed)
    if sum(len(v.text or "") + len(sep) for v in values) > MAX_VALUE_CHARS:
        return Value(None, (f"{TOO_COMPLEX} (a value longer than {MAX_VALUE_CHARS:,} characters)",), assumed)
    return Value(sep.join(v.text or "" for v in values), (), assumed)


# ---------------------------------------------------------------- statements

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
                if tok.text in _REDIRECTS:
                    skip_next = True
                continue
            if skip_next:
                skip_next = False
                continue
            if isinstance(tok, ArrayAssign):
                arrays.append(tok)
                continue
            if in_prefix and keyword is None and _ASSIGN_RE.match(tok.unquoted_prefix):
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
        if isinstance(tok, Op) and tok.text in _SEPARATORS:
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
            targets = [w for w in pending if _ASSIGN_RE.match(w.unquoted_prefix)]
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
        assignment = _ASSIGN_RE.match(w.unquoted_prefix)
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
    prefix = _ASSIGN_RE.match(word.unquoted_prefix)
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
    return _join(values, " ") if values else Value("")


def _assign(scope: Scope, word: Word, conditional: bool, exported: bool, lines: LineIndex) -> None:
    match = _ASSIGN_RE.match(word.unquoted_prefix)
    assert match is not None
    name, append = match.group(1), match.group(2) == "+"
    value = _assignment_value(scope, word)
    line = lines.line_of(word.start)
    old = scope.vars.get(name)
    if append and old is not None:
        value = _join([old.value, value], "")
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
        _join(values[:1], ""),
        values,
        old.exported if old else False,
        line,
        conditional,
        item_words=words if len(words) == len(values) else [],
    )

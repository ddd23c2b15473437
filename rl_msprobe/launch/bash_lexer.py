"""The bash lexer of `launch.bash`: a launch script's text as words, operators and array
assignments, with their spans (`start`, `end`) so the planner can edit the text precisely.

What it reads: backslash-continued lines, single / double / ANSI-C quoting, comments, parameter
expansions (`$X`, `${X:-def}`, `"${ARR[@]}"`), `$((...))`, `$(...)` / backticks, `$@`,
redirections and array assignments (`ARGS=( ... )`, `ARGS+=( ... )`). The limits (`MAX_*`) keep
a hostile script from exhausting memory or time; what passes them is `TOO_COMPLEX`.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGN_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")


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

SEPARATORS = {";", "\n", "&&", "||", "|", "&", ";;", "|&", "(", ")"}
REDIRECTS = {">", ">>", "<", "<<", "<<<", ">&", "<&", "&>", "&>>", ">|", "<>"}


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


class Lexer:
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
        match = ASSIGN_RE.match(word.unquoted_prefix)
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
    return [t for t in Lexer(text).run() if not (isinstance(t, Word) and not t.parts and t.start == t.end)]


def word_parts(text: str) -> tuple[Part, ...]:
    """The parts of `text` read as the inside of a double-quoted word (a `${X:-...}` default, an
    arithmetic body): expansions found, every other character literal."""
    lexer = Lexer(text)
    lexer.pos = 0
    parts: list[Part] = []
    while lexer.pos < len(text):
        word = lexer._word()
        parts.extend(word.parts)
        if lexer.pos < len(text):
            parts.append(Part("lit", text[lexer.pos], True))
            lexer.pos += 1
    return tuple(parts)

"""Static evaluation of bash values for `launch.bash`: the variables a walk has seen (`Scope`) and
the words they expand, known only where that is sound.

A value that depends on run time (an environment variable the script never sets, a command
substitution, a positional argument, an assignment inside a conditional block) carries its
reason, never a guess. `${X:-default}` resolves to the default when the script never sets X, and
says that the environment may override it.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from dataclasses import dataclass, field

from rl_msprobe.launch.bash_lexer import (
    MAX_ARITH_BITS,
    MAX_ARITH_CHARS,
    MAX_NESTING,
    MAX_VALUE_CHARS,
    NAME_RE,
    TOO_COMPLEX,
    ShellSyntaxError,
    Word,
    word_parts,
)


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
                return [join_values(items, " ")]
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
            parts = word_parts(text)
        except ShellSyntaxError as exc:
            return Value(None, (f"cannot read {text!r}: {exc}",))
        values = self.expand(Word(parts, 0, len(text), text), split=False)
        return join_values(values, " ")

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
        return [join_values(f, "") for f in fields]


def join_values(values: list[Value], sep: str) -> Value:
    if len(values) == 1 and not values[0].runtime:
        return values[0]
    runtime = tuple(dict.fromkeys(r for v in values for r in v.runtime))  # doubled by `S="$S$S"`: once each
    assumed = tuple(dict.fromkeys(a for v in values for a in v.assumed))
    if runtime:
        return Value(None, runtime, assumed)
    if sum(len(v.text or "") + len(sep) for v in values) > MAX_VALUE_CHARS:
        return Value(None, (f"{TOO_COMPLEX} (a value longer than {MAX_VALUE_CHARS:,} characters)",), assumed)
    return Value(sep.join(v.text or "" for v in values), (), assumed)

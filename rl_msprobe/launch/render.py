"""Write a derived launch script: the original text with precise, reviewable edits.

- a setting whose key the command already sets in an editable word (in the command or in an
  array assignment) is replaced in place, keeping a `+`/`++` prefix the original needed;
- any other setting is appended after the command's last argument (after `"$@"`, so
  arguments given at run time cannot undo a rule), one per continued line;
- environment variables are exported in a block at the top (so a Ray cluster the script
  starts inherits them) and every later assignment of the same name is given the same value;
  the planner also passes them to the Ray workers through `ray_kwargs.ray_init.runtime_env`.
Nothing else in the text changes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rl_msprobe.launch.overrides import Overrides, render_override, shell_quote
from rl_msprobe.launch.script import LaunchScript


@dataclass(frozen=True)
class Edit:
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Token:
    key: str
    value: object
    prefix: str
    comment: str = ""


def apply_edits(text: str, edits: list[Edit]) -> str:
    out: list[str] = []
    pos = 0
    for edit in sorted(edits, key=lambda e: (e.start, e.end)):
        if edit.start < pos:
            continue  # overlapping edit (same word twice): the first one stands
        out.append(text[pos : edit.start])
        out.append(edit.text)
        pos = edit.end
    out.append(text[pos:])
    return "".join(out)


def _remove_word(text: str, start: int, end: int) -> Edit:
    """Delete a word; when it is alone on a continued line, delete the whole line."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    before, after = text[line_start:start], text[end:line_end]
    if not before.strip() and after.strip() == "\\":
        return Edit(line_start, line_end + 1, "")
    if end < len(text) and text[end] in " \t":
        end += 1
    return Edit(start, end, "")


def _indent_of_line(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    match = re.match(r"[ \t]*", text[start:])
    return match.group(0) if match else ""


def _header_position(text: str) -> int:
    """After the shebang and the comment block right below it."""
    pos = 0
    if text.startswith("#!"):
        end = text.find("\n")
        pos = len(text) if end < 0 else end + 1
    return pos


def render(
    script: LaunchScript,
    overrides: Overrides,
    tokens: list[Token],
    env: list[tuple[str, str, str]],
    header: list[str],
    removals: Sequence[str] = (),
) -> str:
    """The derived script text. `env`: (name, value, why) triples; `removals`: keys to take out."""
    command = script.command
    assert command is not None
    text = script.text
    edits: list[Edit] = []
    appended: list[str] = []
    for token in tokens:
        rendered = render_override(token.key, token.value, token.prefix)
        items = overrides.all_for(token.key)
        replaced = False
        for item in overrides.unreadable_for(token.key):
            if item.arg.editable:  # `key=$(cmd)`, `key=$RUNTIME`, bad syntax: give it the value
                edits.append(Edit(item.arg.word.start, item.arg.word.end, shell_quote(rendered)))
                replaced = True
        last = None
        for item in reversed(overrides.items):
            ov = item.override
            if ov is not None and (ov.key == token.key or token.key.startswith(ov.key + ".")):
                last = item
                break
        if (
            last is not None
            and last.override is not None
            and last.override.key == token.key
            and last.arg.editable
        ):
            for item in items:
                if not item.arg.editable:
                    continue
                prefix = (
                    item.override.prefix
                    if item.override and item.override.prefix in ("+", "++")
                    else token.prefix
                )
                if prefix == "+":
                    prefix = "++"  # `+` fails once the key exists; `++` always works
                new = render_override(token.key, token.value, prefix)
                edits.append(Edit(item.arg.word.start, item.arg.word.end, shell_quote(new)))
            continue
        if replaced and last is None:
            continue
        appended.append(shell_quote(rendered))
    for key in removals:
        for item in overrides.all_for(key):
            if item.arg.editable:
                edits.append(_remove_word(text, item.arg.word.start, item.arg.word.end))
            else:
                appended.append(shell_quote(f"~{key}"))
                break
    # environment: later assignments of the same names get the same value
    names = {name: value for name, value, _ in env}
    for var in script.variables.values():
        if var.name in names:
            for start, end, _line in var.assignments:
                edits.append(Edit(start, end, shell_quote(names[var.name])))
    for word in command.statement.assignments:
        match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\+?=", word.unquoted_prefix)
        if match and match.group(1) in names:
            edits.append(Edit(word.start, word.end, f"{match.group(1)}={shell_quote(names[match.group(1)])}"))
    if appended:
        last_word = command.last_word
        indent = _indent_of_line(text, last_word.start)
        multiline = "\n" in text[command.statement.start : command.statement.end]
        if multiline:
            if not indent:
                indent = "    "
            insertion = "".join(f" \\\n{indent}{tok}" for tok in appended)
        else:
            insertion = "".join(f" {tok}" for tok in appended)
        edits.append(Edit(last_word.end, last_word.end, insertion))
    block = [*header]
    own = _exported_before(script, set(names))  # set in place above; exporting again is noise
    for name, value, why in env:
        if name not in own:
            block.append(f"export {name}={shell_quote(value)}  # {why}")
    if block:
        block_text = "\n".join(block) + "\n"
        pos = _header_position(text)
        if pos == len(text) and text and not text.endswith("\n"):
            block_text = "\n" + block_text
        edits.append(Edit(pos, pos, block_text))
    return apply_edits(text, edits)


def _exported_before(script: LaunchScript, names: set[str]) -> set[str]:
    """NAMES the script itself exports, unconditionally, only before its verl command."""
    assert script.command is not None
    command_line = script.line_of(script.command.statement.start)
    own = set()
    for name in names:
        var = script.variables.get(name)
        if var is None or not var.exported or var.conditional or not var.assignments:
            continue
        if all(line < command_line for *_, line in var.assignments):
            own.add(name)
    return own


def comment(text: str) -> str:
    """A one-line bash comment (no newlines can sneak in)."""
    return "# " + " ".join(text.split())

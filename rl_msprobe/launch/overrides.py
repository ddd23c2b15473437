"""Hydra override tokens of a verl command, read with Hydra's own override grammar.

`parse_override("++a.b=[1,2]")` gives the key, the prefix (`''`, `+`, `++`, `~`) and the
value exactly as Hydra would see it; `render_override` goes the other way and produces a
token that survives both the shell (quoted with `shlex.quote` where needed) and Hydra (values
quoted in Hydra's syntax where they would otherwise parse as something else).
`Overrides` answers "what value does key K end up with" the way Hydra does: the last
override of a key wins, `~key` deletes it, a dict value covers its sub-keys.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from typing import Any

from rl_msprobe.launch.bash_values import Value
from rl_msprobe.launch.script import Arg

_PREFIXES = {"CHANGE": "", "ADD": "+", "FORCE_ADD": "++", "DEL": "~"}
# Hydra's own command-line flags that are not config overrides
_HYDRA_FLAGS = re.compile(
    r"^(--config-name|--config-path|--config-dir|-cn|-cp|-cd|--multirun|-m|--cfg|-c|--resolve|--package|-p|--info|-i|--run|-r|--help|-h|--hydra-help|--version|--shell-completion|-sc|--experimental-rerun)(=|$)"
)
_FLAGS_WITH_VALUE = {
    "--config-name",
    "--config-path",
    "--config-dir",
    "-cn",
    "-cp",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--experimental-rerun",
}


class OverrideError(ValueError):
    pass


@dataclass(frozen=True)
class Override:
    text: str
    key: str
    prefix: str  # '', '+', '++', '~'
    value: Any  # python value (None for `~key` and `key=null`)
    sweep: bool = False

    @property
    def deletes(self) -> bool:
        return self.prefix == "~"


@functools.lru_cache(maxsize=1)
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _plain(value: Any) -> Any:
    """Hydra's parsed value as plain python (sweeps become lists, quoted strings str)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "list") and hasattr(value, "simple_form"):  # ChoiceSweep
        return [_plain(v) for v in value.list]
    return value


# `key.sub=word` / `+key=123`: the common shape, read without Hydra's ANTLR parser (about 1 ms a token,
# so a 20 MB command took minutes); tests/launch/test_overrides.py checks it agrees with Hydra
_SIMPLE = re.compile(
    r"(\+{0,2})([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)="
    r"(?:(0|[1-9][0-9]{0,17})|([A-Za-z_][A-Za-z0-9_]*))"
)
_NOT_STRINGS = {"null", "true", "false", "inf", "nan"}


def simple_override(text: str) -> Override | None:
    """`key=word` / `key=123` read without Hydra's parser (its grammar is slow on huge commands);
    None for anything else, which `parse_override` hands to Hydra."""
    match = _SIMPLE.fullmatch(text)
    if match is None or (match.group(4) or "").lower() in _NOT_STRINGS:
        return None
    prefix, key, number, word = match.groups()
    return Override(text, key, prefix, int(number) if number is not None else word)


@functools.lru_cache(maxsize=4096)
def parse_override(text: str) -> Override:
    """Parse one override token with Hydra's grammar; OverrideError says what is wrong."""
    from hydra.errors import HydraException

    simple = simple_override(text)
    if simple is not None:
        return simple
    try:
        parsed = _parser().parse_override(text)
    except HydraException as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OverrideError(f"{text!r} is not a valid Hydra override: {message}") from None
    sweep = parsed.is_sweep_override()
    key = parsed.key_or_group
    if parsed.package:
        key = f"{key}@{parsed.package}"
    return Override(
        text,
        key,
        _PREFIXES[parsed.type.name],
        None if parsed.type.name == "DEL" else _plain(parsed.value()),
        sweep,
    )


def format_value(value: Any) -> str:
    """Hydra text for a python value, quoted where Hydra would otherwise read something else."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", text):
        try:
            if parse_override(f"k={text}").value == text:
                return text
        except OverrideError:
            pass
    # Hydra quoted strings: only backslashes before a quote (or the closing quote) are escapes
    body = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), text)
    return f'"{body}"'


def render_override(key: str, value: Any, prefix: str = "") -> str:
    """The override token as Hydra must receive it (before shell quoting)."""
    if prefix == "~":
        return f"~{key}"
    return f"{prefix}{key}={format_value(value)}"


def shell_quote(token: str) -> str:
    """Quote a token for bash only when it needs it (`$`, spaces, quotes, globs, ...)."""
    return shlex.quote(token)


def same_value(found: Any, required: Any) -> bool:
    """Compare a value from a script with a required one the way verl would read it."""
    if isinstance(required, bool):
        if isinstance(found, bool):
            return found is required
        return isinstance(found, str) and found.strip().lower() == str(required).lower()
    if isinstance(required, int) and not isinstance(required, bool):
        if isinstance(found, bool):
            return False
        if isinstance(found, int):
            return found == required
        if isinstance(found, float):
            return found == required
        return isinstance(found, str) and found.strip() == str(required)
    if isinstance(required, list):
        return (
            isinstance(found, list)
            and len(found) == len(required)
            and all(same_value(f, r) for f, r in zip(found, required))
        )
    if isinstance(required, str) and not isinstance(found, (dict, list)):
        return found is not None and str(found) == required
    return bool(found == required)


# ---------------------------------------------------------------- the command's overrides


@dataclass(frozen=True)
class Item:
    """One argument of the verl command, read as a Hydra override where it is one."""

    arg: Arg
    override: Override | None  # None: not an override (flag, runtime value, $@)
    problem: str | None = None  # why it could not be read


@dataclass(frozen=True)
class Found:
    value: Any
    item: Item | None  # None: taken from a dict value of a parent key


class Overrides:
    """The overrides of one verl command, in order."""

    def __init__(self, args: list[Arg]):
        self.items: list[Item] = []
        self.flags: dict[str, str | None] = {}
        self.runtime: list[tuple[Arg, tuple[str, ...]]] = []
        self.invalid: list[Item] = []
        pending_flag: str | None = None
        for arg in args:
            value: Value = arg.value
            if pending_flag is not None:
                self.flags[pending_flag] = value.text
                pending_flag = None
                continue
            text = value.text
            if text is None:
                self.runtime.append((arg, value.runtime))
                # a runtime value may still have a readable key: `key=$(cmd)`
                self.items.append(Item(arg, None, "; ".join(value.runtime)))
                continue
            match = _HYDRA_FLAGS.match(text)
            if match:
                flag = match.group(1)
                if match.group(2) == "=":
                    self.flags[flag] = text.split("=", 1)[1]
                elif flag in _FLAGS_WITH_VALUE:
                    pending_flag = flag
                else:
                    self.flags[flag] = None
                continue
            try:
                item = Item(arg, parse_override(text))
            except OverrideError as exc:
                item = Item(arg, None, str(exc))
                self.invalid.append(item)
            self.items.append(item)

    @property
    def config_name(self) -> str | None:
        name = self.flags.get("--config-name") or self.flags.get("-cn")
        if name and name.endswith(".yaml"):
            name = name[: -len(".yaml")]
        return name

    def unreadable_for(self, key: str) -> list[Item]:
        """Arguments for `key` that are not readable overrides (`key=$(...)`, `key=$X`, bad syntax)."""
        out = []
        for item in self.items:
            if item.override is None and item.problem:
                known = item.arg.value.text
                text = known if known is not None else item.arg.word.raw
                if "=" in text and text.split("=", 1)[0].strip("'\"").lstrip("+~") == key:
                    out.append(item)
        return out

    def runtime_key(self, key: str) -> Item | None:
        """The last runtime-valued (or unreadable) argument whose key part reads as `key`."""
        items = self.unreadable_for(key)
        return items[-1] if items else None

    def get(self, key: str) -> Found | None:
        """The value key ends up with after all overrides (None: not set by the script)."""
        for item in reversed(self.items):
            ov = item.override
            if ov is None:
                continue
            if ov.key == key:
                return None if ov.deletes else Found(ov.value, item)
            if key.startswith(ov.key + "."):
                if ov.deletes:
                    return None
                rest = key[len(ov.key) + 1 :].split(".")
                value = ov.value
                for piece in rest:
                    if isinstance(value, dict) and piece in value:
                        value = value[piece]
                    else:
                        break
                else:
                    return Found(value, item)
        return None

    def all_for(self, key: str) -> list[Item]:
        return [i for i in self.items if i.override is not None and i.override.key == key]

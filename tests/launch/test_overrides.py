"""Hydra overrides: parsed with Hydra's grammar, rendered so that bash and Hydra both read them back."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_msprobe.launch.overrides import (
    OverrideError,
    Overrides,
    format_value,
    parse_override,
    render_override,
    same_value,
    shell_quote,
)
from rl_msprobe.launch.script import parse_script


@pytest.mark.parametrize(
    ("text", "key", "prefix", "value"),
    [
        ("a.b=1", "a.b", "", 1),
        ("+a.b=x", "a.b", "+", "x"),
        ("++a.b=[1,2]", "a.b", "++", [1, 2]),
        ("~a.b", "a.b", "~", None),
        ("a={k:1,j:[x,y]}", "a", "", {"k": 1, "j": ["x", "y"]}),
        ('a="1"', "a", "", "1"),
        ("a=True", "a", "", True),
    ],
)
def test_parse_with_hydras_grammar(text: str, key: str, prefix: str, value: object) -> None:
    ov = parse_override(text)
    assert (ov.key, ov.prefix, ov.value) == (key, prefix, value)


def test_invalid_override_is_reported() -> None:
    with pytest.raises(OverrideError, match="not a valid Hydra override"):
        parse_override('a=/x/"y"')


def test_last_override_wins_and_delete_and_dict_parent() -> None:
    script = parse_script(
        "python3 -m verl.trainer.main_ppo a.b=1 a.b=2 ~c.d c.d=5 ~c.d e={f:3} --config-name x.yaml\n"
    )
    ov = Overrides(script.command.args)  # type: ignore[union-attr]
    assert ov.get("a.b").value == 2  # type: ignore[union-attr]
    assert ov.get("c.d") is None
    assert ov.get("e.f").value == 3  # type: ignore[union-attr]
    assert ov.config_name == "x"


@pytest.mark.parametrize(
    ("found", "required", "same"),
    [
        ("True", True, True),
        ("false", True, False),
        ("4", 4, True),
        (True, 1, False),
        ([1, "2"], [1, 2], True),
    ],
)
def test_same_value(found: object, required: object, same: bool) -> None:
    assert same_value(found, required) is same


scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(10**9), max_value=10**9),
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"))
        | st.sampled_from(list(" $'\"\\`*?[]{},=:")),
        max_size=20,
    ),
)
values = st.one_of(
    scalars,
    st.lists(
        st.one_of(st.booleans(), st.integers(0, 100), st.from_regex(r"[a-z_]{1,8}", fullmatch=True)),
        max_size=4,
    ),
)


@settings(max_examples=300, deadline=None)
@given(value=values, prefix=st.sampled_from(["", "+", "++"]))
def test_rendered_override_survives_bash_and_hydra(value: object, prefix: str) -> None:
    token = render_override("a.b_c", value, prefix)
    word = shell_quote(token)
    (back,) = shlex.split(word)
    assert back == token
    parsed = parse_override(back)
    assert parsed.prefix == prefix and parsed.key == "a.b_c"
    assert parsed.value == value and type(parsed.value) is type(value)


@settings(max_examples=100, deadline=None)
@given(value=values)
def test_rendered_override_reads_back_through_the_script_reader(value: object) -> None:
    word = shell_quote(render_override("k", value))
    script = parse_script(f"python3 -m verl.trainer.main_ppo {word}\n")
    ov = Overrides(script.command.args)  # type: ignore[union-attr]
    found = ov.get("k")
    assert found is not None and found.value == value


def test_format_value_quotes_what_would_parse_as_something_else() -> None:
    assert format_value("1") == '"1"'
    assert format_value("true") == '"true"'
    assert format_value("/abs/path.json") == "/abs/path.json"
    assert format_value("has space") == '"has space"'


@settings(max_examples=300, deadline=None)
@given(
    st.from_regex(r"\+{0,2}[A-Za-z_][A-Za-z0-9_]{0,5}(\.[A-Za-z_][A-Za-z0-9_]{0,4}){0,2}=", fullmatch=True),
    st.one_of(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True),
        st.from_regex(r"(0|[1-9][0-9]{0,19})", fullmatch=True),
        st.sampled_from(
            ["null", "True", "FALSE", "inf", "NaN", "nan", "Null", "true1", "0x10", "007", "1e3"]
        ),
    ),
)
def test_the_fast_path_reads_a_plain_override_as_hydra_does(key: str, value: str) -> None:
    """`key=word` / `key=123` skip Hydra's parser (a 2 MB command took minutes): same key, prefix and value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rl_msprobe.launch.overrides import simple_override

    text = key + value
    fast = simple_override(text)
    if fast is None:
        return
    parsed = OverridesParser.create().parse_override(text)
    assert (fast.key, fast.prefix, fast.value) == (parsed.key_or_group, key[: key.count("+")], parsed.value())
    assert type(fast.value) is type(parsed.value())

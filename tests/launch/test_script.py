"""The launch-script reader: quoting, variables, arrays, arithmetic, run-time values."""

from __future__ import annotations

import pytest

from rl_msprobe.launch.bash_lexer import ShellSyntaxError
from rl_msprobe.launch.script import parse_script


def args_of(text: str) -> list[str | None]:
    script = parse_script(text)
    assert script.command is not None
    return [a.value.text for a in script.command.args]


def test_backslash_style_with_variables_and_trailing_args() -> None:
    text = 'gen_tp=4\npython3 -m verl.trainer.main_ppo \\\n    a.b=${gen_tp} \\\n    c="x y" \\\n    $@\n'
    script = parse_script(text)
    assert script.command is not None and script.command.extra_args
    assert [a.value.text for a in script.command.args][:2] == ["a.b=4", "c=x y"]
    assert script.command.args[-1].value.text is None


def test_arrays_expand_into_the_command_with_their_source_words() -> None:
    text = 'DATA=(\n  a=1  # comment\n  "b=two words"\n)\nDATA+=(c=3)\npython3 -m verl.trainer.main_ppo "${DATA[@]}" d=4\n'
    script = parse_script(text)
    assert script.command is not None
    assert [a.value.text for a in script.command.args] == ["a=1", "b=two words", "c=3", "d=4"]
    assert [a.origin for a in script.command.args][:3] == ["array DATA"] * 3
    assert all(a.editable for a in script.command.args)
    assert script.text[script.command.args[1].word.start : script.command.args[1].word.end] == '"b=two words"'


def test_defaults_arithmetic_and_assumptions() -> None:
    text = "N=${NNODES:-2}\nG=$((N * 8 / 2))\npython3 -m verl.trainer.main_ppo x=$G y=$((1024 * 2)) z=${UNSET:-$N}\n"
    script = parse_script(text)
    assert script.command is not None
    values = [a.value for a in script.command.args]
    assert [v.text for v in values] == ["x=8", "y=2048", "z=2"]
    assert values[0].assumed and "NNODES" in values[0].assumed[0]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("x=$(nvidia-smi -L | wc -l)", "command run at run time"),
        ("x=$ENGINE", "comes from the environment"),
        ("x=`hostname`", "command run at run time"),
        ("x=$1", "only known at run time"),
    ],
)
def test_run_time_values_are_reported_never_guessed(line: str, reason: str) -> None:
    script = parse_script(f"python3 -m verl.trainer.main_ppo {line}\n")
    assert script.command is not None
    value = script.command.args[0].value
    assert value.text is None and reason in value.runtime[0]


def test_assignment_in_a_conditional_depends_on_run_time() -> None:
    text = 'TP=2\nif [ -n "$BIG" ]; then\n  TP=8\nfi\npython3 -m verl.trainer.main_ppo a.tp=$TP\n'
    value = parse_script(text).command.args[0].value  # type: ignore[union-attr]
    assert value.text is None and "conditional" in value.runtime[0]


def test_quoting_styles() -> None:
    text = (
        "X='single $NOT'\nY=$'tab\\there'\n"
        'python3 -m verl.trainer.main_ppo a="$X" b="$Y" \'c=["q","r"]\' d=e\\ f "g=\\"h\\""\n'
    )
    assert args_of(text) == ["a=single $NOT", "b=tab\there", 'c=["q","r"]', "d=e f", 'g="h"']


def test_unquoted_expansion_splits_like_bash() -> None:
    assert args_of('ARGS="a=1 b=2"\npython3 -m verl.trainer.main_ppo $ARGS "$ARGS"\n') == [
        "a=1",
        "b=2",
        "a=1 b=2",
    ]


def test_exports_and_command_prefix_env() -> None:
    text = "export A=1 B=two\nC=3\nexport C\nD=4 python3 -m verl.trainer.main_ppo x=1\n"
    script = parse_script(text)
    env = {e.name: (e.value.text, e.how) for e in script.command.env}  # type: ignore[union-attr]
    assert env == {
        "A": ("1", "export"),
        "B": ("two", "export"),
        "C": ("3", "export"),
        "D": ("4", "command prefix"),
    }


def test_heredoc_function_and_pipes_do_not_confuse_the_reader() -> None:
    text = (
        'log() { echo "$*"; }\n'
        "cat <<EOF\npython3 -m verl.trainer.main_ppo not=this\nEOF\n"
        "python3 -m verl.trainer.main_ppo real=1 2>&1 | tee log.txt\n"
    )
    script = parse_script(text)
    assert script.command is not None and [a.value.text for a in script.command.args] == ["real=1"]
    assert script.other_commands == []


@pytest.mark.parametrize(
    ("entry_line", "entry", "fully_async"),
    [
        (
            "python3 -m verl.experimental.fully_async_policy.fully_async_main a=1",
            "verl.experimental.fully_async_policy.fully_async_main",
            True,
        ),
        ("python /opt/verl/verl/trainer/main_ppo.py a=1", "/opt/verl/verl/trainer/main_ppo.py", False),
        ("ray job submit --no-wait -- python3 -m verl.trainer.main_ppo a=1", "verl.trainer.main_ppo", False),
    ],
)
def test_entry_points(entry_line: str, entry: str, fully_async: bool) -> None:
    script = parse_script(entry_line + "\n")
    assert script.command is not None
    assert script.command.entry == entry and script.command.fully_async is fully_async
    assert [a.value.text for a in script.command.args] == ["a=1"]


@pytest.mark.parametrize("text", ["echo 'open\n", 'x="open\n', "A=(a b\n", "echo $(date\n"])
def test_syntax_errors_name_the_line(text: str) -> None:
    with pytest.raises(ShellSyntaxError, match="line 1"):
        parse_script(text)


def test_no_verl_command() -> None:
    assert parse_script("echo hello\npython3 train.py\n").command is None


def test_a_backslash_ending_the_file_is_a_continuation_like_in_bash() -> None:
    text = 'ARGS=(a=1)\npython3 -m verl.trainer.main_ppo \\\n    "${ARGS[@]}" \\'
    script = parse_script(text)
    assert script.command is not None
    assert [a.value.text for a in script.command.args] == ["a=1"]
    assert script.command.last_word.raw == '"${ARGS[@]}"'


def test_crlf_line_ends_continue_lines() -> None:
    text = 'python3 -m verl.trainer.main_ppo \\\r\n  a=1 \\\r\n  b="x\\\r\ny"\r\n'
    assert args_of(text) == ["a=1", "b=xy"]


def test_positional_defaults_are_assumptions() -> None:
    script = parse_script("ENGINE=${1:-vllm}\npython3 -m verl.trainer.main_ppo name=$ENGINE raw=$2\n")
    assert script.command is not None
    name, raw = script.command.args
    assert name.value.text == "name=vllm"
    assert any("argument given to the script" in a for a in name.value.assumed)
    assert raw.value.text is None and raw.value.runtime


@pytest.mark.parametrize(
    "expr",
    [
        "$(( ((9**64)**64)**64 ))",
        "$((1<<99999999999))",
        "$((" + "+".join(["1"] * 3000) + "))",
        "$((" + "+".join(["1"] * 20000) + "))",
        "${A:-" * 500 + "x" + "}" * 500,
    ],
    ids=["power-tower", "huge-shift", "deep-expression", "long-expression", "nested-defaults"],
)
def test_too_complex_values_are_unverifiable_not_stuck(expr: str) -> None:
    script = parse_script(f"X={expr}\npython3 -m verl.trainer.main_ppo a=$X\n")
    assert script.command is not None
    value = script.command.args[0].value
    assert value.text is None and "too complex to evaluate; reported as unverifiable" in value.runtime[0]


def test_line_numbers_on_a_long_script() -> None:
    text = "X=1\n" * 20000 + "python3 -m verl.trainer.main_ppo a=$X\n"
    script = parse_script(text)
    assert script.command is not None and script.command.statement.line == 20001
    assert script.line_of(len(text) - 1) == 20001

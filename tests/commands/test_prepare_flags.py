"""prepare's flags as one frozen value: every click option has its field, and the typed text
becomes the planner's values (or a UserError naming the option)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from rl_msprobe.commands.planner import prepare
from rl_msprobe.commands.prepare_flags import PrepareFlags, int_list
from rl_msprobe.errors import UserError


def test_every_prepare_option_is_a_field() -> None:
    assert [p.name for p in prepare.params] == [f.name for f in fields(PrepareFlags)]


def test_the_request_carries_the_parsed_choices() -> None:
    argv = ["run.sh", "--steps", "[1, 2]", "--ranks", "0", "--stages", " actor_update, ,ref_compute_log_prob"]
    argv += ["--no-pd", "--python", "py3", "--task", "tensor", "--weights", "--json"]
    flags = PrepareFlags(**prepare.make_context("prepare", argv).params)
    assert (flags.script, flags.as_json, flags.force, flags.trees) == ("run.sh", True, False, ())
    request = flags.request("text", "/abs/run.sh")
    assert (request.text, request.path, request.task, request.with_weights) == (
        "text",
        "/abs/run.sh",
        "tensor",
        True,
    )
    opts = request.options
    assert (opts.level, opts.risk_level, opts.steps, opts.ranks) == ("mix", "FOCUS", [1, 2], [0])
    assert opts.stages == ["actor_update", "ref_compute_log_prob"]
    assert (opts.pd, opts.python, opts.backend) == (False, "py3", None)


@pytest.mark.parametrize("text", ["1,x", "-1", "1;2"])
def test_a_list_that_is_not_numbers_names_the_option(text: str) -> None:
    with pytest.raises(UserError, match="^--ranks "):
        int_list(text, "--ranks")


def test_no_list_is_none_and_an_empty_one_is_empty() -> None:
    assert int_list(None, "--steps") is None
    assert int_list("[]", "--steps") == []

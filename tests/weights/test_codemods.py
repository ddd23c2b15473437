"""verl-weights codemods on their fixtures: exact output, idempotent, byte-exact revert, CRLF, and
a loud refusal where the class is there but the sync site is not."""

from __future__ import annotations

import pytest

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.codemods.verl_weights import VerlWeightsReceived, VerlWeightsSent
from tests.support.codemod_cases import FIXTURES, check_invalid, check_pair

FOLDER = FIXTURES / "verl_weights"


def _case(path) -> Codemod:
    return VerlWeightsSent() if path.name.startswith("sent_") else VerlWeightsReceived()


@pytest.mark.parametrize("before", sorted(FOLDER.glob("*.before.py")), ids=lambda p: p.name)
def test_pairs(before):
    check_pair(_case(before), before, before.with_name(before.name.replace(".before.", ".after.")))


@pytest.mark.parametrize("path", sorted(FOLDER.glob("*.invalid.py")), ids=lambda p: p.name)
def test_drifted_sources_are_refused(path):
    check_invalid(_case(path), path)


def test_a_file_without_the_class_is_not_its_subject():
    assert not VerlWeightsSent().present("class Other:\n    pass\n")
    assert not VerlWeightsReceived().present("def f():\n    pass\n")

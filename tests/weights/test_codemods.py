"""verl-weights codemods on their fixtures: exact output, idempotent, byte-exact revert, CRLF, and
a loud refusal where the class is there but the sync site is not."""

from __future__ import annotations

from rl_msprobe.codemods.verl_weights import VerlWeightsReceived, VerlWeightsSent


def test_a_file_without_the_class_is_not_its_subject():
    assert not VerlWeightsSent().present("class Other:\n    pass\n")
    assert not VerlWeightsReceived().present("def f():\n    pass\n")

"""verl-weights and sglang-weights codemods: what is their subject, and a loud refusal where the
sync site is not there (the fixture cases run in tests/codemods/test_every_codemod.py)."""

from __future__ import annotations

from rl_msprobe.codemods.verl_weights import VerlWeightsReceived, VerlWeightsSent


def test_a_file_without_the_class_is_not_its_subject():
    assert not VerlWeightsSent().present("class Other:\n    pass\n")
    assert not VerlWeightsReceived().present("def f():\n    pass\n")


def test_sglang_weights_fails_loudly_where_no_class_has_the_update_entry(tmp_path):
    """A real SGLang tree (0.5.12) whose update_weights_from_tensor was renamed away: no piece
    applies, so the set's capability has no site: exit 2 naming it, and nothing is written."""
    from rl_msprobe.codemods.sglang_weights import SGLangWeightsReceived, SGLangWeightsUpdater
    from tests.support.trees import run_cli, scratch_copy, snapshot

    assert SGLangWeightsReceived().present(
        "class ModelRunner:\n    def update_weights_from_tensor(self, t):\n        pass\n"
    )
    assert not SGLangWeightsUpdater().present(
        "class WeightUpdater:\n    def update_weights_from_disk(self):\n        pass\n"
    )
    tree = scratch_copy("sglang", "0.5.12", tmp_path / "sglang", with_git=False)
    runner = tree / "sglang/srt/model_executor/model_runner.py"
    runner.write_text(runner.read_text().replace("def update_weights_from_tensor(", "def load_from_tensor("))
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "sglang-weights", "--tree", str(tree))
    assert code == 2, err
    assert "received + resident fingerprints" in err and "update_weights_from_tensor" in err, err
    assert snapshot(tree) == before

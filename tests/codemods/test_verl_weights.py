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


def test_the_bucket_receiver_settles_right_after_each_bucket_is_loaded():
    """verl 0.9.1's receiver (cached release): `arrived(metadata, settles=True)` after the metadata
    arrives, `settled()` right after the callback (the bucket loaded, its buffer not yet reused);
    without the callback's call the set refuses, naming it."""
    import pytest

    from rl_msprobe.codemods.base import AnchorError
    from rl_msprobe.codemods.verl_weights import VerlWeightsBucket
    from rl_msprobe.upstream.release_cache import fetch_release

    path = fetch_release("verl", "0.9.1") / VerlWeightsBucket.path
    source = path.read_text(encoding="utf-8")
    lines = [x.strip() for x in VerlWeightsBucket().apply(source).splitlines()]
    callback = lines.index("on_bucket_received(weights, is_last)")
    assert lines[callback + 1].startswith("rl_msprobe_weights.settled()"), lines[callback : callback + 2]
    assert any(x.startswith("rl_msprobe_weights.arrived(metadata, settles=True)") for x in lines)
    unloaded = source.replace("on_bucket_received(weights, is_last)", "pass")
    with pytest.raises(AnchorError, match="bucket callback"):
        VerlWeightsBucket().apply(unloaded)

"""The dump-size estimate of a whole-response compare against real msprobe dumps of the stand-in, and
what it says for a 7B model with a 1k-token response."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_msprobe.dumps import position_size
from rl_msprobe.dumps.position_size import QWEN2_5_7B, ModelShape, estimate
from rl_msprobe.errors import UserError

TINY = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512)


def _bytes(folders: list[Path]) -> int:
    """What msprobe writes for the compare: dump.json and the tensor files (not stack/construct)."""
    return sum(
        p.stat().st_size
        for f in folders
        for p in f.rglob("*")
        if p.is_file() and (p.suffix == ".pt" or p.name == "dump.json")
    )


def test_the_estimate_matches_real_dumps_of_the_stand_in(position_dumps: dict[str, Path]) -> None:
    every = tuple(TINY.modules())  # the stand-in dumps every module (L0), the head included
    e = estimate(TINY, 8, 6, modules=every, dtype_bytes=4, head=True)
    steps = sorted((position_dumps["clean"]).glob("step*"), key=lambda p: int(p.name[4:]))
    measured = {
        "prefill": _bytes(steps[:1]),
        "decode (tensor)": _bytes(steps[1:]),
        "train": _bytes([position_dumps["train"]]),
        "decode (statistics)": _bytes([position_dumps["decode_plant_stats"]]),
    }
    stats = estimate(TINY, 8, 6, modules=every, dtype_bytes=4, head=True, decode_task="statistics")
    tensor = estimate(TINY, 8, 6, modules=every, dtype_bytes=4, head=True, decode_task="tensor")
    assert e == stats
    for what, want in (
        ("prefill", e.rollout_prefill),
        ("decode (tensor)", tensor.rollout_decode),
        ("train", e.train),
        ("decode (statistics)", stats.rollout_decode),
    ):
        assert want == pytest.approx(measured[what], rel=0.3), (what, want, measured)


def test_a_7b_model_with_a_1k_token_response() -> None:
    e = estimate(QWEN2_5_7B, 256, 1024)
    gib = position_size.GIB
    # weights dominate a tensor-mode forward: msprobe writes each dumped module's parameters
    assert 25 * gib < e.total < 45 * gib
    assert e.rollout_decode < 0.5 * gib  # statistics: JSON only
    tensor = estimate(QWEN2_5_7B, 256, 1024, decode_task="tensor")
    assert tensor.rollout_decode > 1000 * e.rollout_decode  # the weights again at every step
    norms = estimate(QWEN2_5_7B, 256, 1024, modules=("input_layernorm", "post_attention_layernorm"))
    two_layers = estimate(QWEN2_5_7B, 256, 1024, layers=[0, 27])
    assert norms.total < 4 * gib and two_layers.total < e.total / 5
    assert estimate(QWEN2_5_7B, 256, 2048).train > e.train
    assert "GiB" in e.describe() and "tensor files" in e.describe()


def test_bad_input_names_the_key() -> None:
    with pytest.raises(UserError, match="`num_hidden_layers` is None"):
        ModelShape.from_config(
            {"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 4}
        )
    with pytest.raises(UserError, match="module\\(s\\) lm_head"):
        estimate(TINY, 4, 4, modules=("lm_head",))
    shape = ModelShape.from_config(
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        }
    )
    assert shape == QWEN2_5_7B


def test_the_whole_response_estimate_grows_with_the_response_and_the_requests() -> None:
    from rl_msprobe.dumps.position_size import whole_response

    one = whole_response(28, 512, 1024)
    assert one.rollout > one.records > 0 and one.total == one.rollout + one.records
    assert whole_response(28, 512, 2048).rollout == 2 * one.rollout
    assert whole_response(28, 512, 1024, requests=8).total == 8 * one.total
    assert "8 request(s)" in whole_response(28, 512, 1024, requests=8).describe()
    with pytest.raises(UserError, match="at least 1"):
        whole_response(0, 512, 1024)

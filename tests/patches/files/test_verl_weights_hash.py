"""The k64 checksum of sent and received tensors (rl_msprobe_weights._Keyed): the properties
docs/commands/weights.md and the helper claim, each tried where it is weakest (sign bits, the top bit of a word,
tails, block edges, pieces that start mid-word)."""

from __future__ import annotations

import pytest
import torch

from tests.weights.helper import load

helper = load()
GEN = torch.Generator().manual_seed(7)


def flipped(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    """T with one bit of its row-major bytes flipped."""
    out = t.clone().contiguous()
    raw = out.view(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit
    return out


def test_the_keys_are_splitmix64_and_odd():
    """Fixed by definition in every process: splitmix64's first output for seed 0 (0xe220a8397b1dcdaf,
    the published reference value) is the first key; every key is odd (a bijection of its word)."""
    keys = helper._word_keys()
    assert int(keys[0]) == 0xE220A8397B1DCDAF
    assert keys.size == helper.WORDS and bool((keys & 1).all())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]
)
def test_any_single_bit_change_is_caught(dtype, monkeypatch):
    """Every bit of a word, the sign bits included, at the first word, a key-block edge and the
    tail; a small key block so that the tensor spans several."""
    monkeypatch.setattr(helper, "WORDS", 64)
    t = torch.randn(1027, generator=GEN).to(dtype)  # 1027 elements: a byte count no multiple of 8
    base = helper.digest(t)
    nbytes = t.numel() * t.element_size()
    for byte in sorted({0, 7, 8, 64 * 8 - 1, 64 * 8, nbytes // 2, nbytes - 1}):
        for bit in range(8):
            assert helper.digest(flipped(t, byte, bit)) != base, (byte, bit)


def test_changes_in_two_words_that_cancel_a_plain_sum_are_caught():
    """The top bit of a word reaches the low bits before the keyed sum: negating two float64
    elements, or two float32 elements in the high halves of two words, would cancel out of an
    unfolded multiply-sum (2**63 times any odd key is 2**63); here they change the checksum."""
    d = torch.randn(64, dtype=torch.float64, generator=GEN)
    negated = d.clone()
    negated[[3, 40]] *= -1
    assert helper.digest(negated) != helper.digest(d)
    f = torch.randn(64, generator=GEN)
    negated = f.clone()
    negated[[1, 3]] *= -1
    assert helper.digest(negated) != helper.digest(f)


def test_the_blind_spot_the_statistics_cover():
    """What the fold leaves: the same bits flipped in both halves of a word (both float32 of an
    aligned pair negated) change it by 2**63 only, so two such words cancel. The statistics of the
    same record see it (the sum moves), and compare reports a tensor that differs in either."""
    f = torch.randn(64, generator=GEN)
    negated = f.clone()
    negated[[20, 21, 40, 41]] *= -1
    assert helper.digest(negated) == helper.digest(f)
    assert helper.fingerprint(negated)["sum"] != helper.fingerprint(f)["sum"]


def test_order_matters():
    """Two elements swapped, rows reversed, the same bytes read as another shape: each differs."""
    t = torch.randn(32, 48, generator=GEN)
    swapped = t.clone()
    swapped[0, 0], swapped[31, 47] = t[31, 47], t[0, 0]
    variants = (swapped, t.flip(0), t.reshape(48, 32), t.view(torch.int32).float())
    assert len({helper.digest(x) for x in (t, *variants)}) == 1 + len(variants)


def test_equal_bytes_give_equal_checksums_however_they_are_laid_out():
    """A contiguous copy, a strided view, and a view at an odd place in a byte bucket (verl's
    buckets align a tensor to its element size only) hold the same row-major bytes: one checksum."""
    t = torch.randn(45, 33, generator=GEN).bfloat16()
    bucket = torch.zeros(3 + t.numel() * 2 + 8, dtype=torch.uint8)
    at = bucket[2 : 2 + t.numel() * 2]
    at.copy_(t.reshape(-1).view(torch.uint8))
    in_bucket = at.view(torch.bfloat16).view(t.shape)
    strided = t.t().contiguous().t()
    assert not strided.is_contiguous()
    assert helper.digest(t) == helper.digest(t.clone()) == helper.digest(in_bucket) == helper.digest(strided)


def test_dtype_shape_and_padding_are_part_of_it():
    """The tail word is zero-padded, so the header must tell [1, 2, 3] from [1, 2, 3, 0]; the same
    bytes as another dtype or shape differ too."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)
    padded = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float16)
    raw = a.view(torch.int16)
    assert len({helper.digest(x) for x in (a, padded, raw, a.reshape(3, 1))}) == 4
    assert helper.digest(torch.empty(0)) != helper.digest(torch.empty(0, 3))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2, torch.int64]
)
@pytest.mark.parametrize("size", [1, 7, 64 * 3, 64 * 5 + 3, 1027])
def test_the_device_checksum_is_the_same_k64(dtype, size, monkeypatch):
    """`_device_digest` (int64 tensor arithmetic, for a tensor on a GPU / NPU) gives `digest`'s value,
    over key blocks, device steps of several blocks and their zero-padded ends, on views that start
    mid-word. Run here on CPU tensors: the same torch operations a device runs, not a device (none
    is lent to this machine; on one, `digest` takes this path)."""
    monkeypatch.setattr(helper, "WORDS", 16)
    monkeypatch.setattr(helper, "DEVICE_BLOCKS", 3)
    t = (torch.randn(size + 3, generator=GEN) * 100).to(dtype)
    for view in (t[:size], t[3:], t[1 : size + 1].reshape(-1, 1)):
        assert helper._device_digest(view) == helper.digest(view), (dtype, size, view.storage_offset())
    assert helper._device_digest(flipped(t, t.numel() * t.element_size() - 1, 7)) != helper._device_digest(t)


def test_the_device_checksum_of_a_strided_tensor_is_its_row_major_bytes():
    t = torch.randn(6, 10, generator=GEN)
    assert helper._device_digest(t.t()) == helper.digest(t.t().contiguous()) == helper.digest(t.t())
    assert helper._device_digest(t[:, 2:7]) == helper.digest(t[:, 2:7])

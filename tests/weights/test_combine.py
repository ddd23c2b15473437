"""The combine rules over random tensors: split, fused, sharded, padded, permuted, replicated, tied.

Fingerprints are taken by the job-side helper itself; combining them with rl_msprobe.weights must
give the fingerprint of the whole tensor (equal within float64 accumulation), and a x1.001 change
of one element block must not.
"""

from __future__ import annotations

import pytest
import torch

from rl_msprobe.weights.fingerprint import (
    Fingerprint,
    combine_ranks,
    compare,
    concat,
    deduplicate,
    unit_roundoff,
)
from tests.weights.helper import load

helper = load()


def fp(t: torch.Tensor) -> Fingerprint:
    return Fingerprint.from_dict(helper.fingerprint(t))


@pytest.fixture(params=[0, 1, 2])
def gen(request):
    return torch.Generator().manual_seed(1000 + request.param)


def test_shards_add_up_to_the_whole_in_any_order(gen):
    rows = int(torch.randint(8, 40, (1,), generator=gen))
    whole = torch.randn(rows * 4, 24, generator=gen)
    shards = list(whole.chunk(4, dim=0))
    order = torch.randperm(len(shards), generator=gen).tolist()
    combined, replicas = combine_ranks([fp(shards[i]) for i in order], whole.numel())
    assert replicas == 1
    assert compare(fp(whole), combined).equal
    column_shards = whole.chunk(3, dim=1)  # row-parallel layers shard the input dimension
    assert compare(fp(whole), concat(fp(s) for s in column_shards)).equal


def test_fused_qkv_sharded_over_tp_splits_back_into_q_k_v(gen):
    heads, kv_heads, head, hidden, tp = 4, 2, 8, 16, 2
    q, k, v = (torch.randn(n * head, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    # what each TP rank's fused qkv_proj holds: its q heads, then its k heads, then its v heads
    ranks = [torch.cat([t.chunk(tp)[r] for t in (q, k, v)]) for r in range(tp)]
    sizes = [heads * head // tp, kv_heads * head // tp, kv_heads * head // tp]
    for name, whole, part in (("q", q, 0), ("k", k, 1), ("v", v, 2)):
        offset = sum(sizes[:part])
        shards = [fp(r.narrow(0, offset, sizes[part])) for r in ranks]
        combined, replicas = combine_ranks(shards, whole.numel())
        assert replicas == 1 and compare(fp(whole), combined).equal, name
    fused = concat(fp(r) for r in ranks)  # the fused total is q + k + v as sent
    assert compare(concat([fp(q), fp(k), fp(v)]), fused).equal


def test_kv_heads_replicated_when_tp_exceeds_kv_heads(gen):
    kv_heads, head, hidden, tp = 2, 8, 16, 4  # each kv head on tp / kv_heads = 2 ranks
    k = torch.randn(kv_heads * head, hidden, generator=gen)
    held = [fp(k.chunk(kv_heads)[r * kv_heads // tp]) for r in range(tp)]
    combined, replicas = combine_ranks(held, k.numel())
    assert replicas == tp // kv_heads
    assert compare(fp(k), combined).equal
    held[3] = fp(k.chunk(kv_heads)[1] * 1.001)  # one rank's copy altered: the combination differs
    assert not compare(fp(k), combine_ranks(held, k.numel())[0]).equal


def test_replicated_norm_and_one_rank_altered(gen):
    norm = torch.randn(64, generator=gen)
    combined, replicas = combine_ranks([fp(norm)] * 2, norm.numel())
    assert replicas == 2 and compare(fp(norm), combined).equal
    altered = norm.clone()
    altered[5] *= 1.001
    assert not compare(fp(norm), combine_ranks([fp(norm), fp(altered)], norm.numel())[0]).equal


def test_vocab_padding_rows_are_not_part_of_the_tensor(gen):
    vocab, hidden, tp, pad_to = 500, 16, 2, 64
    embed = torch.randn(vocab, hidden, generator=gen)
    per_rank = -(-vocab // tp // pad_to) * pad_to  # vLLM pads each rank's rows
    shards = []
    for r in range(tp):
        rows = embed[r * per_rank : (r + 1) * per_rank]
        padded = torch.zeros(per_rank, hidden)
        padded[: len(rows)] = rows
        shards.append((padded, len(rows)))
    # the helper fingerprints only the rows the loader wrote (shard_indices.num_org_elements)
    trimmed = [fp(p.narrow(0, 0, n)) for p, n in shards]
    assert compare(fp(embed), combine_ranks(trimmed, embed.numel())[0]).equal
    with pytest.raises(ValueError):  # padding counted in: not a whole number of copies
        combine_ranks([fp(p) for p, _ in shards], embed.numel())


def test_permutation_is_invisible_but_a_change_is_not(gen):
    w = torch.randn(96, 32, generator=gen)
    packed = w.reshape(-1)[torch.randperm(w.numel(), generator=gen)].reshape(48, 64)  # a repacked layout
    assert compare(fp(w), fp(packed)).equal
    changed = w.clone()
    changed[:, 3] *= 1.001
    delta = compare(fp(w), fp(changed))
    assert not delta.equal and 0 < delta.norm_rel < 1e-3


def test_tied_weights_fingerprint_once():
    emb = torch.nn.Embedding(32, 8)
    head = torch.nn.Linear(8, 32, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
    assert helper._aliases(model) == {"lm_head.weight": "embed_tokens.weight"}


def test_dtype_rounding_is_within_tolerance_only_for_that_dtype(gen):
    w = torch.randn(128, 64, generator=gen)
    rounded = w.to(torch.bfloat16)
    assert not compare(fp(w), fp(rounded)).equal  # same-dtype rules: a rounding is a difference
    assert compare(fp(w), fp(rounded), unit_roundoff("bfloat16")).equal


def test_nan_and_inf_are_counted_and_compared():
    w = torch.randn(50)
    bad = w.clone()
    bad[3], bad[7] = float("nan"), float("inf")
    f = fp(bad)
    assert (f.nan, f.inf, f.count) == (1, 1, 50)
    assert not compare(fp(w), f).equal
    assert deduplicate(concat([f, f]), 2) == f


def test_empty_tensor_and_hash():
    assert fp(torch.empty(0)).count == 0
    a = torch.arange(10, dtype=torch.float32)
    assert helper.digest(a) == helper.digest(a.clone()) != helper.digest(a.to(torch.float64))
    b = a.clone()
    b[0] = -0.0  # same statistics, other bits
    assert helper.digest(a) != helper.digest(b)

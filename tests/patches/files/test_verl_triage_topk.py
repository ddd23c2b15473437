"""The helper's top-k path (verl/utils/rl_msprobe_triage.py) on plain torch tensors: the rollout
server keeps its top k, the trainer sends the ids to the engine, the engine's log-softmax at the
response positions comes back, and the line's ``distribution`` holds both sides at the same
positions. The vLLM output and verl's micro-batch are stand-ins (SimpleNamespace, a dict with a
jagged ``input_ids``): the live triage job runs the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from rl_msprobe.triage.distribution import parse, position_metrics
from tests.patches.files.test_verl_triage import batch, helper, lines  # noqa: F401 - the fixture

K = 3
V = 16


def server_output(logp_rows, sampled):
    """vLLM's CompletionOutput.logprobs: per position {token id: Logprob(logprob, rank)}, top K and the sampled."""
    out = []
    for row, tok in zip(logp_rows, sampled):
        order = torch.argsort(row, descending=True).tolist()
        keep = {t: SimpleNamespace(logprob=float(row[t]), rank=r + 1) for r, t in enumerate(order[:K])}
        keep.setdefault(tok, SimpleNamespace(logprob=float(row[tok]), rank=order.index(tok) + 1))
        out.append(keep)
    return SimpleNamespace(logprobs=out)


def test_both_sides_at_the_same_positions(helper, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("RL_MSPROBE_TRIAGE", str(tmp_path))
    monkeypatch.setenv("RL_MSPROBE_TRIAGE_TOPK", str(K))
    data = batch()  # prompts [5, 6] and [7, 8, 9, 10]; responses of 3 and 2 counted tokens
    prompts = [[5, 6], [7, 8, 9, 10]]
    responses = [[11, 12, 13], [14, 15]]
    gen = torch.Generator().manual_seed(0)
    seqs = [p + r for p, r in zip(prompts, responses)]
    logits = torch.randn(sum(len(s) for s in seqs), V, generator=gen)
    # the rollout: the same logits at the response positions, a little noise
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    topk, seen = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        rows = logits[offsets[i] + len(p) - 1 : offsets[i] + len(p) - 1 + len(r)]
        lp = torch.log_softmax(rows + 0.01 * torch.randn(rows.shape, generator=gen), -1)
        extra: dict = {}
        params = {"logprobs": 0}
        helper.ask_top_k(params)
        assert params["logprobs"] == K
        helper.keep_top_k(server_output(lp, r), p, extra)
        topk.append(extra[helper.TOPK_KEY])
        seen.append(extra[helper.PROMPT_KEY])
    seen[1] = [7, 8, 9, 99]  # the rollout saw another prompt for request 1
    data.non_tensor_batch[helper.TOPK_KEY] = np.array(topk, dtype=object)
    data.non_tensor_batch[helper.PROMPT_KEY] = np.array(seen, dtype=object)
    td: dict = {}
    helper.send_rollout_top_k(data, td)
    assert td[helper.IDS_KEY].shape == (2, 3, K)
    micro = {
        "input_ids": torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged),
        helper.IDS_KEY: td[helper.IDS_KEY],
    }
    model_output: dict = {}
    labels = torch.roll(torch.cat([torch.tensor(s) for s in seqs]), -1)  # verl's input_ids_rmpad_rolled
    log_probs = torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)  # verl's, just before
    data.batch["entropys"] = torch.rand(2, 3)  # verl's entropy of the old-log-prob call
    with torch.no_grad():
        helper.train_top_k(logits, micro, model_output, log_probs, labels)
        fallback: dict = {}
        helper.train_top_k(logits, micro, fallback)  # no log-probs at hand: its own logsumexp
        rounded: dict = {}  # bf16 log-probs (verl on CPU autocast) must not round the logsumexp
        helper.train_top_k(logits, micro, rounded, log_probs.bfloat16(), labels)
    for a, b in zip(rounded[helper.OUT_KEY].unbind(), fallback[helper.OUT_KEY].unbind()):
        assert torch.equal(a, b)
    for a, b in zip(model_output[helper.OUT_KEY].unbind(), fallback[helper.OUT_KEY].unbind()):
        assert torch.allclose(a, b, atol=1e-5)
    helper.keep_train_top_k(model_output)
    helper.log_requests(data, SimpleNamespace(global_steps=1))
    first, second = lines(tmp_path)
    assert first["schema"] == "rl-msprobe-triage/2"
    assert "rollout_prompt_ids" not in first and second["rollout_prompt_ids"] == [7, 8, 9, 99]
    for i, line in enumerate((first, second)):
        req = parse(line["distribution"])
        n = len(line["response_ids"])
        assert req.positions == n
        full = torch.log_softmax(logits[offsets[i] + len(prompts[i]) - 1 :][:n], -1).numpy()
        rows = np.arange(n)[:, None]
        assert np.allclose(req.train_at_rollout, full[rows, req.rollout_ids], atol=1e-6)
        assert np.array_equal(req.train_ids, np.argsort(-full, axis=1)[:, :K])
        assert np.allclose(req.entropy, data.batch["entropys"][i, :n].numpy(), atol=1e-7)
        m = position_metrics(req)
        assert np.all(m["kl_low"] < 1e-2) and np.all(m["overlap"] > 0)


def test_off_without_top_k(helper, monkeypatch):  # noqa: F811
    monkeypatch.delenv("RL_MSPROBE_TRIAGE_TOPK", raising=False)
    params = {"logprobs": 0}
    helper.ask_top_k(params)
    extra: dict = {}
    helper.keep_top_k(SimpleNamespace(logprobs=[]), [1], extra)
    assert params == {"logprobs": 0} and extra == {}
    out: dict = {}
    helper.train_top_k(torch.zeros(2, 4), {"input_ids": None}, out)
    assert out == {}


def test_transfer_queue_samples_carry_the_ids_in_extra_fields(helper, monkeypatch):  # noqa: F811
    """The v1 trainer hands the engine every field of its samples: the ids come from extra_fields."""
    monkeypatch.setenv("RL_MSPROBE_TRIAGE_TOPK", str(K))
    seqs = [[5, 6, 11, 12, 13], [7, 8, 14, 15]]
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(1))
    tops = [
        {"ids": [[1, 2, 3]] * 3, "lps": [[-1.0, -2.0, -3.0]] * 3},
        {"ids": [[4, 5, 6]] * 2, "lps": [[-1.0] * 3] * 2},
    ]
    extra = [{helper.TOPK_KEY: t, "request_id": str(i)} for i, t in enumerate(tops)]
    micro = {
        "input_ids": torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged),
        "extra_fields": extra,
    }
    out: dict = {}
    helper.train_top_k(logits, micro, out)
    first, second = out[helper.OUT_KEY].unbind()
    assert first.shape == (3, 1 + 3 * K) and second.shape == (2, 1 + 3 * K)
    full = torch.log_softmax(logits, -1)
    assert torch.allclose(
        first[:, 1 : 1 + K], full[1:4][:, [1, 2, 3]], atol=1e-6
    )  # rows 1..3 predict 11, 12, 13
    assert torch.allclose(
        second[:, 1 : 1 + K], full[6:8][:, [4, 5, 6]], atol=1e-6
    )  # rows 6, 7 predict 14, 15
    grad = logits.clone().requires_grad_(True)
    out = {}
    helper.train_top_k(grad, micro, out)  # the update's forward: nothing
    assert out == {}

"""The per-token records path of the sglang-dispatch-log helper (`rl_msprobe_dispatch.py`), on a real
torch model behind a stand-in ModelRunner and ForwardBatch shaped like SGLang's (0.5.10 - 0.5.23:
`forward_mode`, `rids`, `extend_prefix_lens_cpu` / `extend_seq_lens_cpu`, `seq_lens_cpu`,
`input_ids`; the model's forward called as `model.forward(...)`, its last module
`logits_processor` returning a non-tensor). The passes a real engine does not show in a short
generate (chunked prefill, mixed batches, speculative and idle passes, a pass that raises, a
pipeline stage without a logits processor) are checked here; the real engine runs in
test_sglang_records_e2e.py.
"""

from __future__ import annotations

import enum
import json
from types import SimpleNamespace as NS

import pytest

from tests.support.added_files import load_with_records

torch = pytest.importorskip("torch")


class Mode(enum.Enum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


@pytest.fixture
def helper(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path / "rec"))
    return load_with_records(
        "sglang/sglang/srt/model_executor/rl_msprobe_dispatch.py",
        "rl_msprobe_dispatch_records_under_test",
        "sglang.srt.model_executor",
        monkeypatch,
    )


class Processor(torch.nn.Module):
    def forward(self, hidden, fail=False):
        if fail:
            raise RuntimeError("logits failed")
        return NS(next_token_logits=hidden.sum(-1))  # SGLang: a LogitsProcessorOutput, not a tensor


class Model(torch.nn.Module):
    def __init__(self, last=True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(64, 8)
        self.layer = torch.nn.Linear(8, 8)
        if last:
            self.logits_processor = Processor()

    def forward(self, input_ids, positions, forward_batch, fail_at=None):
        hidden = self.layer(self.embed_tokens(input_ids))
        if fail_at == "layer":
            raise RuntimeError("layer failed")
        if hasattr(self, "logits_processor"):
            return self.logits_processor(hidden, fail=fail_at == "logits")
        return hidden


class Runner:
    tp_rank, tp_size = 0, 1

    def __init__(self, helper, last=True):
        self.helper = helper
        self.model = Model(last)
        self.msprobe_debugger = None

    def forward(self, forward_batch, fail_at=None):
        self.helper.log_forward(self, forward_batch)  # the marked first line
        return self.model.forward(forward_batch.input_ids, None, forward_batch, fail_at=fail_at)


def extend(rids, prefixes, lens, mode=Mode.EXTEND):
    ids = torch.arange(sum(lens)) % 60
    return NS(
        forward_mode=mode, rids=rids, extend_prefix_lens_cpu=prefixes, extend_seq_lens_cpu=lens, input_ids=ids
    )


def decode(rids, seq_lens):
    return NS(forward_mode=Mode.DECODE, rids=rids, seq_lens_cpu=seq_lens, seq_lens=torch.tensor(seq_lens),
              input_ids=torch.arange(len(rids)))  # fmt: skip


def headers(tmp_path) -> list[dict]:
    files = sorted((tmp_path / "rec").rglob("rec*.json"), key=lambda p: int(p.stem[3:]))
    return [json.loads(p.read_text()) for p in files]


def hooked(runner) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


def test_chunked_mixed_and_decode_passes(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "a,c")
    runner = Runner(helper)
    # a chunk of a long prompt (16 tokens done), a new prompt, c's first chunk
    runner.forward(extend(["a", "b", "c"], [16, 0, 0], [4, 3, 5]))
    # a mixed pass: a decodes (one extend token at 20), c's second chunk
    runner.forward(extend(["a", "c"], [20, 5], [1, 2], mode=Mode.MIXED))
    runner.forward(decode(["c", "b", "a"], [8, 4, 22]))
    assert not hooked(runner)
    first, mixed, last = headers(tmp_path)
    assert (first["phase"], first["requests"], first["token_rows"]) == (
        "prefill",
        ["a", "c"],
        [[0, 16, 4], [1, 0, 5]],
    )
    assert (mixed["phase"], mixed["token_rows"]) == ("mixed", [[0, 20, 1], [1, 5, 2]])
    assert (last["phase"], last["requests"], last["token_rows"]) == (
        "decode",
        ["c", "a"],
        [[0, 7, 1], [1, 21, 1]],
    )
    assert first["engine"] == "sglang" and (first["tp_rank"], first["tp_size"]) == (0, 1)
    # the embedding's input: the selected rows' token ids (rows 0-3 of a, 7-11 of c)
    (embed,) = [t for t in first["tensors"] if "embed_tokens" in t["key"] and t["label"] == "input.0"]
    assert embed["rows"] == "token" and embed["width"] == 1


def test_passes_not_recorded_hook_nothing(helper, tmp_path, monkeypatch):
    runner = Runner(helper)
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "zzz")
    runner.forward(extend(["a"], [0], [3]))
    monkeypatch.delenv("RL_MSPROBE_RECORD_IDS")
    runner.forward(extend(["a"], [3], [2], mode=Mode.TARGET_VERIFY))  # speculative verify
    runner.forward(NS(forward_mode=Mode.IDLE, rids=[], input_ids=torch.zeros(0, dtype=torch.long)))
    assert not hooked(runner) and headers(tmp_path) == []


def test_a_pass_that_raises_leaves_no_record_and_no_hook(helper, tmp_path):
    runner = Runner(helper)
    with pytest.raises(RuntimeError, match="logits failed"):
        runner.forward(extend(["a"], [0], [3]), fail_at="logits")
    assert not hooked(runner) and headers(tmp_path) == []  # always_call on the logits processor
    with pytest.raises(RuntimeError, match="layer failed"):
        runner.forward(extend(["a"], [0], [3]), fail_at="layer")
    assert hooked(runner)  # the logits processor never ran: the next pass discards it
    runner.forward(decode(["a"], [4]))
    assert not hooked(runner)
    assert [h["token_rows"] for h in headers(tmp_path)] == [[[0, 3, 1]]]


def test_a_stage_without_logits_processor_writes_at_the_next_pass(helper, tmp_path):
    runner = Runner(helper, last=False)  # a pipeline stage before the last
    runner.forward(extend(["a"], [0], [3]))
    runner.forward(decode(["a"], [4]))
    assert [h["token_rows"] for h in headers(tmp_path)] == [[[0, 0, 3]]]

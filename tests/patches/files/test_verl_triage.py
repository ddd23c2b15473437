"""The helper the verl-triage set adds (verl/utils/rl_msprobe_triage.py), on plain torch tensors."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

HELPER = Path(__file__).resolve().parents[3] / "rl_msprobe/patches/files/verl/verl/utils/rl_msprobe_triage.py"


@pytest.fixture
def helper(monkeypatch):
    monkeypatch.delenv("RL_MSPROBE_TRIAGE", raising=False)
    spec = importlib.util.spec_from_file_location("rl_msprobe_triage_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(with_response_mask: bool = True):
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    responses = torch.tensor([[11, 12, 13], [14, 15, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    rollout = torch.tensor([[-0.5, -1.25, -2.0], [-0.1, -0.2, 0.0]], dtype=torch.float32) / 3
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention,
        "rollout_log_probs": rollout,
        "old_log_probs": rollout + 0.01,
    }
    if with_response_mask:
        tensors["response_mask"] = torch.tensor([[1, 0, 1], [1, 1, 0]])
    non_tensor = {"request_id": np.array(["a", "b"], dtype=object), "uid": np.array(["u", "u"], dtype=object)}
    return SimpleNamespace(batch=tensors, non_tensor_batch=non_tensor)


def lines(folder: Path) -> list[dict]:
    (path,) = folder.glob("*/triage.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_without_its_variable(helper, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert helper.log_requests(batch(), SimpleNamespace(global_steps=1)) is None
    assert list(tmp_path.iterdir()) == []
    assert not re.search(r"^\s*(import|from)\s+msprobe", HELPER.read_text(), re.M)  # never imports msprobe


def test_one_line_per_request_with_verls_mask(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_TRIAGE", str(tmp_path))
    data = batch()
    helper.log_requests(data, SimpleNamespace(global_steps=4))
    first, second = lines(tmp_path)
    assert first["step"] == 4 and first["request_id"] == "a" and first["uid"] == "u" and first["index"] == 0
    assert first["prompt_ids"] == [5, 6] and first["prompt_len"] == 2  # left padding dropped
    assert first["response_ids"] == [11, 12, 13] and first["mask"] == [1, 0, 1]
    assert second["response_ids"] == [14, 15] and "mask" not in second  # up to the last counted token
    assert second["prompt_ids"] == [7, 8, 9, 10]
    for line, row in ((first, 0), (second, 1)):
        n = len(line["response_ids"])
        # 9 significant digits: every float32 comes back exactly
        assert np.array_equal(
            np.float32(line["rollout_log_probs"]), data.batch["rollout_log_probs"][row, :n].numpy()
        )
        assert np.array_equal(
            np.float32(line["train_log_probs"]), data.batch["old_log_probs"][row, :n].numpy()
        )


def test_attention_mask_when_there_is_no_response_mask(helper, tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_TRIAGE", str(tmp_path))
    helper.log_requests(batch(with_response_mask=False), SimpleNamespace(global_steps=1))
    first, second = lines(tmp_path)
    assert first["response_ids"] == [11, 12, 13] and "mask" not in first
    assert second["response_ids"] == [14, 15]


def test_a_broken_batch_is_one_error_line_not_a_crash(helper, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RL_MSPROBE_TRIAGE", str(tmp_path))
    data = batch()
    del data.batch["old_log_probs"]
    helper.log_requests(data, SimpleNamespace(global_steps=2))
    helper.log_requests(data, SimpleNamespace(global_steps=3))
    errors = lines(tmp_path)
    assert [e["step"] for e in errors] == [2, 3] and "old_log_probs" in errors[0]["error"]
    assert capsys.readouterr().err.count("rl-msprobe triage: could not log") == 1  # said once

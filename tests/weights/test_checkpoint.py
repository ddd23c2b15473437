"""`weights compare DIR --checkpoint CKPT`: the checkpoint on disk against what the engine holds at
the first sync, through the sync compare's layout knowledge (fused parts, TP shards, tied names),
on safetensors files written here byte by byte as the format says."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from rl_msprobe.errors import UserError
from rl_msprobe.weights.checkpoint import compare_checkpoint, read_checkpoint
from rl_msprobe.weights.records import read_run
from tests.support.trees import run_cli
from tests.weights import synthetic

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = (
            t.contiguous().view(torch.uint8).numpy().tobytes()
            if t.dtype == torch.bfloat16
            else t.numpy().tobytes()
        )
        header[name] = {
            "dtype": CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _job(tmp_path: Path, tp: int = 2) -> Path:
    return synthetic.write(tmp_path / "w", syncs=2, tp=tp)


def _checkpoint(tmp_path: Path, change: str | None = None, dtype=torch.float32) -> Path:
    weights = synthetic.model(1)  # what the engine holds at sync 1 (synthetic.write: seed + sync)
    if change:
        weights[change] = weights[change] * 1.01
    write_safetensors(tmp_path / "ckpt" / "model.safetensors", {n: t.to(dtype) for n, t in weights.items()})
    return tmp_path / "ckpt"


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unchanged_checkpoint_is_equal(tmp_path, tp):
    doc = compare_checkpoint(read_run(_job(tmp_path, tp)), read_checkpoint(_checkpoint(tmp_path)))
    assert doc["verdict"] == "EQUAL" and doc["sync"] == 1, doc["counts"]
    assert doc["checkpoint_tensors"] == len(synthetic.model()) and doc["counts"]["tied"] == 1


def test_a_changed_tensor_on_disk_is_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"  # inside the engine's fused qkv_proj, TP 2
    doc = compare_checkpoint(read_run(_job(tmp_path)), read_checkpoint(_checkpoint(tmp_path, change=name)))
    assert doc["verdict"] == "DIFFERENT" and doc["first_difference"]["name"] == name
    assert [r["name"] for r in doc["tensors"] if r["status"] == "differs"] == [name]
    code, out, _ = run_cli("weights", "compare", str(tmp_path / "w"), "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 1 and f"first difference: {name}" in out and out.rstrip().endswith("DIFFERENT"), out


def test_a_bf16_checkpoint_of_an_fp32_engine_is_one_rounding_away(tmp_path):
    doc = compare_checkpoint(
        read_run(_job(tmp_path)), read_checkpoint(_checkpoint(tmp_path, dtype=torch.bfloat16))
    )
    assert doc["verdict"] == "EQUAL", [r for r in doc["tensors"] if r["status"] != "equal"][:3]


def test_a_later_sync_holds_other_weights_and_bad_input_is_named(tmp_path):
    run = read_run(_job(tmp_path))
    ckpt = read_checkpoint(_checkpoint(tmp_path))
    assert compare_checkpoint(run, ckpt, sync=2)["verdict"] == "DIFFERENT"  # trained since the checkpoint
    with pytest.raises(UserError, match="--sync 7"):
        compare_checkpoint(run, ckpt, sync=7)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.safetensors"):
        read_checkpoint(tmp_path / "empty")
    bad = tmp_path / "bad" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(
        UserError, match="model.safetensors: not a valid safetensors file .invalid JSON in header"
    ):
        read_checkpoint(bad.parent)

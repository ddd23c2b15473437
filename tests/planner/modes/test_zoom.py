"""prepare --mode consistency --zoom: msprobe mix dumps of one layer's block, one request (msprobe's
request_id slice), the prompt's forward; decode positions and engines without the slice refused."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.errors import UserError
from rl_msprobe.planner.modes.zoom import ZoomTarget, msprobe_lists, read_report, zoom_target
from tests.planner.conftest import CORPUS
from tests.planner.modes.test_modes import plan

VLLM = "run_qwen2_7b_grpo_fsdp_vllm.sh"
TARGET = ZoomTarget("req-b", 3, "model.layers.3.mlp.down_proj", 2, "prefill", 10)


def test_the_block_of_a_leaf_module_is_named_alike_on_both_engines() -> None:
    lists = msprobe_lists(TARGET)
    assert lists["generate"] == ["layers.3.mlp."]
    assert lists["actor"] == ["layers.3.mlp.", "layers.3._fsdp_wrapped_module.mlp."]
    fsdp = ZoomTarget("r", 3, "Module.model.layers.3._fsdp_wrapped_module.self_attn.q_proj.Linear.forward.0")
    assert fsdp.block == "self_attn"
    assert msprobe_lists(ZoomTarget("r", 7))["generate"] == ["layers.7."]


@pytest.mark.parametrize(
    "doc",
    [
        {"first_divergence": {"request_id": "req-b-0badcafe", "position": 2, "module": "model.layers.3.mlp"}},
        {
            "requests": [
                {
                    "request": "req-b",
                    "first": {
                        "pos": 2,
                        "key": "Module.model.layers.3.mlp.Qwen2MLP.forward.0",
                        "request_id": "req-b",
                    },
                }
            ]
        },  # fmt: skip
        {"divergences": [{"request_id": "req-b", "position": 2, "module": "model.layers.3.mlp", "layer": 3}]},
    ],
)
def test_the_report_is_read_defensively(tmp_path: Path, doc: dict) -> None:
    path = tmp_path / "positions.json"
    path.write_text(json.dumps(doc))
    found = read_report(str(path))
    assert (found["request_id"].startswith("req-b"), found["position"], found["layer"]) == (True, 2, 3)
    target = zoom_target(str(path), None, None, None, None)
    assert target is not None and (target.request_id, target.layer, target.block) == ("req-b", 3, "mlp")


def test_flags_alone_and_over_the_report(tmp_path: Path) -> None:
    assert zoom_target(None, None, None, None, None) is None
    t = zoom_target(None, "req-x", None, "model.layers.5.self_attn.o_proj", 1)
    assert t is not None and (t.request_id, t.layer, t.block, t.position) == ("req-x", 5, "self_attn", 1)
    with pytest.raises(UserError, match="needs a request and a layer"):
        zoom_target(None, "req-x", None, None, None)
    empty = tmp_path / "clean.json"
    empty.write_text(json.dumps({"verdict": "CONSISTENT", "requests": []}))
    with pytest.raises(UserError, match="names no first divergence"):
        zoom_target(str(empty), None, None, None, None)


def test_a_decode_position_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "positions.json"
    path.write_text(json.dumps({"first_divergence": {"request_id": "r", "position": 12, "module": "model.layers.0.mlp",
                                                     "phase": "decode"}}))  # fmt: skip
    with pytest.raises(UserError, match="decode.*one-token forward.*dumps positions"):
        zoom_target(str(path), None, None, None, None)
    # by hand, without the report's prompt length, a position is taken as the prompt's (the helper
    # dumps the prefill only): the flags cannot tell a decode position
    t = zoom_target(None, "r", 0, None, 12)
    assert t is not None and t.position == 12


def test_the_plan_sets_request_id_list_and_the_prompt_only(tmp_path: Path) -> None:
    p = plan(VLLM, "consistency", tmp_path, zoom=TARGET)
    stats = {role: doc[doc["task"]] for role, (_, doc) in p.configs.items()}
    assert stats["generate"]["request_id"] == stats["actor"]["request_id"] == "req-b"
    assert stats["generate"]["list"] == ["layers.3.mlp."]
    assert "layers.3._fsdp_wrapped_module.mlp." in stats["actor"]["list"]
    assert all(doc["level"] == "mix" for _, doc in p.configs.values())
    assert "MSPROBE_ROLLOUT_PHASES=prefill" in p.derived_text and "PROMPTS_ONLY=1" in p.derived_text
    (note,) = [n for n in p.notes if n.startswith("Zoom: msprobe mix dumps of mlp of layer 3")]
    # the command it prints pastes as is: the folder holding both dumps, no <placeholder> (issue 45)
    command = note.split("`")[1]
    folders = {os.path.dirname(doc["dump_path"]) for _, doc in p.configs.values()}
    assert "<" not in command and command == f"rl-msprobe dumps zoom {shlex.quote(folders.pop())}", note
    assert {os.path.basename(doc["dump_path"]) for _, doc in p.configs.values()} == {"actor", "generate"}


def test_sglang_and_level_l0_are_refused(tmp_path: Path) -> None:
    sglang = plan("run_qwen3_8b_arrays_fsdp_sglang.sh", "consistency", tmp_path, zoom=TARGET)
    assert "consistency.zoom.engine" in [v.rule for v in sglang.violations]
    l0 = plan(VLLM, "consistency", tmp_path, zoom=TARGET, level="L0")
    assert "consistency.zoom.level" in [v.rule for v in l0.violations]


def test_prepare_takes_the_zoom_flags(tmp_path: Path) -> None:
    script = tmp_path / VLLM
    script.write_text((CORPUS / VLLM).read_text())
    res = CliRunner().invoke(
        main,
        ["prepare", str(script), "--mode", "consistency", "--zoom-request", "req-b", "--zoom-layer", "3",
         "--zoom-module", "model.layers.3.mlp.down_proj", "--json", "--out", str(tmp_path / "out")],
    )  # fmt: skip
    doc = json.loads(res.stdout)
    actor = json.loads(Path(doc["configs"]["actor"]).read_text())
    assert actor["statistics"]["request_id"] == "req-b" and actor["level"] == "mix", res.output


def test_the_report_dumps_positions_writes_is_read(tmp_path: Path) -> None:
    """`dumps positions --json` on real records (the shared writer on a tiny model, two planted faults):
    the prompt's divergence is the zoom's target (the zoom dumps prompt forwards); a report whose only
    divergence is in the response is refused with the reason."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    from tests.dumps import record_models as rm

    lengths = {"A": (6, 4), "B": (4, 6)}

    def report(name: str, *plants: rm.Plant) -> Path:
        root = rm.write_job(
            tmp_path / name,
            rm.tokens_of(lengths),
            {},
            rm.batched_schedule(lengths, chunk=2),
            [["A", "B"]],
            plants=plants,
        )
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rl_msprobe",
                "dumps",
                "positions",
                str(root),
                "--out",
                str(tmp_path / f"{name}-o"),
                "--json",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        path = tmp_path / f"{name}.json"
        path.write_text(out.stdout)
        return path

    both = report(
        "both",
        rm.Plant("rollout", "model.layers.0.self_attn.o_proj", "A", 7),  # A's response
        rm.Plant("rollout", "model.layers.1.mlp.down_proj", "B", 2),  # B's prompt
    )
    target = zoom_target(str(both), None, None, None, None)
    assert target == ZoomTarget("B", 1, "model.layers.1.mlp.down_proj", 2, "prefill", 4)
    assert target.block == "mlp"
    decode = report("decode", rm.Plant("rollout", "model.layers.0.self_attn.o_proj", "A", 7))
    with pytest.raises(UserError, match="is a response \\(decode\\) position"):
        zoom_target(str(decode), None, None, None, None)

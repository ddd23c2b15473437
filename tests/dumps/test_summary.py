"""Reading msprobe's compare CSV (hand-made rows in msprobe 26.2.0's column layout)."""

from __future__ import annotations

import csv
from pathlib import Path

from rl_msprobe.dumps.summary import module_of, summarize

HEAD = ["NPU Name", "Bench Name", "Cosine", "MaxAbsErr", "MaxRelativeErr", "Result", "Err_message"]
T = "Module._fsdp_wrapped_module.model.layers.{l}._fsdp_wrapped_module.{m}.forward.0.{x}"
R = "Module.model.layers.{l}.{m}.forward.0.{x}"


def _row(layer, train_mod, roll_mod, x, cos, err, result="pass", msg="[]"):
    return [
        T.format(l=layer, m=train_mod, x=x) if train_mod else "N/A",
        R.format(l=layer, m=roll_mod, x=x) if roll_mod else "N/A",
        cos,
        err,
        "0.1",
        result,
        msg,
    ]


def _csv(tmp_path: Path, rows: list[list[str]], head: list[str] = HEAD) -> Path:
    p = tmp_path / "compare_result_1.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerows(rows)
    return p


def test_module_of() -> None:
    assert module_of("Module.model.layers.1.mlp.down_proj.RowParallelLinear.forward.0.output.0") == (
        "model.layers.1.mlp.down_proj",
        "output.0",
    )
    assert module_of(T.format(l=0, m="self_attn.q_proj.Linear", x="input.0") + ";  x") == (
        "model.layers.0.self_attn.q_proj",
        "input.0",
    )
    assert module_of("Functional.linear.3.forward.output.0") == ("Functional.linear", "output.0")


def test_first_divergence_skips_structural_rows(tmp_path: Path) -> None:
    rows = [
        [
            "Module._fsdp_wrapped_module.model.embed_tokens.Embedding.forward.0.output.0",
            "Module.model.embed_tokens.VocabParallelEmbedding.forward.0.output.0",
            "1.0",
            "0.0",
            "0",
            "pass",
            "[]",
        ],
        _row(
            0,
            "mlp.act_fn.SiLUActivation",
            "mlp.act_fn.SiluAndMul",
            "output.0",
            "-0.01",
            "0.6",
            "error",
            '["error: x"]',
        ),
        _row(0, "", "self_attn.attn.Attention", "output.0", "unsupported", "unsupported"),
        _row(
            0,
            "Qwen2DecoderLayer",
            "Qwen2DecoderLayer",
            "input.0",
            "shape unmatched",
            "shape unmatched",
            "error",
        ),
        _row(0, "mlp.down_proj.Linear", "mlp.down_proj.RowParallelLinear", "output.0", "1.0", "1e-7"),
        _row(
            1, "mlp.down_proj.Linear", "mlp.down_proj.RowParallelLinear", "parameters.weight", "0.7", "0.08"
        ),
        _row(
            1,
            "mlp.Qwen2MLP",
            "mlp.Qwen2MLP",
            "output.0",
            "0.72",
            "0.03",
            "error",
            '["error: One Thousandth"]',
        ),
        _row(
            1,
            "Qwen2DecoderLayer",
            "Qwen2DecoderLayer",
            "output.0",
            "0.98",
            "0.03",
            "warning",
            '["warning: c"]',
        ),
        [
            "Module._fsdp_wrapped_module.lm_head.Linear.forward.0.output.0",
            "Module.lm_head.ParallelLMHead.forward.0.output.0",
            "0.97",
            "0.2",
            "1",
            "pass",
            "[]",
        ],
    ]
    s = summarize(_csv(tmp_path, rows))
    assert s.mode == "tensor"
    assert s.counts == {"pass": 5, "error": 3, "warning": 1}
    assert s.not_comparable == 3
    first = s.first_divergence
    assert (first.module, first.tensor, first.layer, first.cosine) == (
        "model.layers.1.mlp",
        "output.0",
        1,
        0.72,
    )
    # rl-msprobe's rule: the decoder layer's output only carries the MLP's error (msprobe warns on it)
    assert [r.module for r in s.divergent] == ["model.layers.1.mlp"]
    assert [r.module for r in s.rows if r.msprobe_flagged] == ["model.layers.1.mlp", "model.layers.1"]
    assert not s.consistent
    assert s.worst(1)[0].module == "model.layers.1.mlp.down_proj"  # lowest cosine: the weight
    curve = {p.layer: (p.cosine, p.max_abs_err, p.divergent) for p in s.layers}
    assert curve == {
        "embed": (1.0, 0.0, 0),
        "0": (1.0, 1e-7, 0),
        "1": (0.72, 0.03, 1),
        "head": (0.97, 0.2, 0),
    }
    assert [p.depth for p in s.layers] == [-1, 0, 1, 2]


def test_shape_mismatch_of_an_output_is_a_divergence(tmp_path: Path) -> None:
    rows = [
        _row(
            0,
            "input_layernorm.Qwen2RMSNorm",
            "input_layernorm.RMSNorm",
            "output.0",
            "shape unmatched",
            "shape unmatched",
            "error",
            '["error: The shape of NPU and Bench are inconsistent."]',
        ),
    ]
    s = summarize(_csv(tmp_path, rows))
    assert s.first_divergence is not None and s.first_divergence.cosine is None
    assert not s.consistent


def test_all_pass_is_consistent(tmp_path: Path) -> None:
    rows = [_row(i, "mlp.Qwen2MLP", "mlp.Qwen2MLP", "output.0", "1.0", "1e-6") for i in range(3)]
    s = summarize(_csv(tmp_path, rows))
    assert s.consistent and s.first_divergence is None
    assert s.to_json()["divergent_rows"] == 0


def test_statistics_mode_uses_max_diff(tmp_path: Path) -> None:
    p = tmp_path / "compare_result_2.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["NPU Name", "Bench Name", "Max diff", "NormRelativeErr", "Result", "Err_message"])
        w.writerow(
            [
                T.format(l=0, m="mlp.Qwen2MLP", x="output.0"),
                R.format(l=0, m="mlp.Qwen2MLP", x="output.0"),
                "-0.5",
                "12.5%",
                "warning",
                "[]",
            ]
        )
    s = summarize(p)
    assert s.mode == "statistics"
    row = s.rows[0]
    assert (row.cosine, row.max_abs_err, row.rel_err) == (None, 0.5, 12.5)
    assert s.first_divergence is row


def test_vllm_conventions_are_not_divergences(tmp_path: Path) -> None:
    """What a real vLLM CPU engine against transformers' Qwen2 with identical weights gives."""
    layout = '["error: The dtype of NPU and Bench are inconsistent."]'
    rows = [
        [
            "Module._fsdp_wrapped_module.model.embed_tokens.Embedding.forward.0.input.0",
            "Module.model.embed_tokens.VocabParallelEmbedding.forward.0.input.0",
            "1.0",
            "0.0",
            "0",
            "error",
            layout,
        ],
        _row(
            0,
            "post_attention_layernorm.Qwen2RMSNorm",
            "post_attention_layernorm.RMSNorm",
            "input.0",
            "0.91",
            "0.05",
        ),
        _row(0, "", "post_attention_layernorm.RMSNorm", "input.1", "N/A", "N/A"),
        _row(
            0,
            "post_attention_layernorm.Qwen2RMSNorm",
            "post_attention_layernorm.RMSNorm",
            "output.0",
            "1.0",
            "1e-6",
        ),
        _row(
            0,
            "Qwen2DecoderLayer",
            "Qwen2DecoderLayer",
            "output.0",
            "0.22",
            "0.12",
            "error",
            '["error: One Thousandth"]',
        ),
        _row(0, "", "Qwen2DecoderLayer", "output.1", "N/A", "N/A"),
        _row(1, "mlp.down_proj.Linear", "mlp.down_proj.RowParallelLinear", "output.0", "1.0", "1e-8"),
    ]
    s = summarize(_csv(tmp_path, rows))
    assert s.consistent, [(r.module, r.tensor, r.note) for r in s.divergent]
    notes = {(r.module, r.tensor): r.note for r in s.rows}
    assert "int32" in notes[("model.embed_tokens", "input.0")]
    assert "residual" in notes[("model.layers.0.post_attention_layernorm", "input.0")]
    assert "residual" in notes[("model.layers.0", "output.0")]
    assert (
        notes[("model.layers.0.post_attention_layernorm", "output.0")] == ""
    )  # the norm's output is compared
    assert {p.layer: p.cosine for p in s.layers}["0"] == 1.0


def test_token_ids_that_differ_mean_the_pair_is_not_compared(tmp_path: Path) -> None:
    """Input identity before any layer is judged: integer input rows (token ids) that differ make
    the pair NOT COMPARED, never a divergence at layer 0."""
    head = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "Max diff", "Min diff", "Mean diff"]
    head += ["L2norm diff", "NormRelativeErr", "Result", "Err_message"]
    ids = [
        "Module._fsdp_wrapped_module.model.embed_tokens.Embedding.forward.0.input.0",
        "Module.model.embed_tokens.VocabParallelEmbedding.forward.0.input.0",
        "torch.int64",
        "torch.int32",
    ]
    out = [T.format(l=0, m="mlp.Qwen2MLP", x="output.0"), R.format(l=0, m="mlp.Qwen2MLP", x="output.0")]
    out += ["torch.float32", "torch.float32", "0.5", "0.1", "0.1", "3", "20%", "pass", "[]"]
    same = summarize(_csv(tmp_path, [[*ids, "0", "0", "0", "0", "0%", "pass", "[]"]], head))
    assert same.input_mismatch is None and same.inputs_checked == ["model.embed_tokens input.0"]
    d = tmp_path / "differ"
    d.mkdir()
    s = summarize(_csv(d, [[*ids, "17", "0", "2.5", "40", "3%", "pass", "[]"], out], head))
    assert s.input_mismatch and "model.embed_tokens input.0" in s.input_mismatch, s.input_mismatch
    assert not s.inputs_checked


def test_statistics_shape_complaints_read_like_the_consistency_checker(tmp_path: Path) -> None:
    shape_msg = '["error: The shape of NPU and Bench are inconsistent."]'
    head = ["NPU Name", "Bench Name", "NPU Tensor Shape", "Bench Tensor Shape", "Max diff", "NormRelativeErr"]
    cases = [  # (layer, train module, rollout module, train shape, rollout shape)
        (0, "mlp.Qwen2MLP", "mlp.Qwen2MLP", "[1, 8, 128]", "[8, 128]"),
        (
            0,
            "self_attn.q_proj.Linear",
            "self_attn.qkv_proj.QKVParallelLinear",
            "[1, 8, 128];[1, 8, 64]",
            "[8, 256]",
        ),
        (1, "mlp.Qwen2MLP", "mlp.Qwen2MLP", "[1, 9, 128]", "[8, 128]"),  # 9 tokens against 8: a real finding
    ]
    p = tmp_path / "compare_result_3.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*head, "Result", "Err_message"])
        for layer, tm, rm, ts, rs in cases:
            names = [T.format(l=layer, m=tm, x="output.0"), R.format(l=layer, m=rm, x="output.0")]
            w.writerow([*names, ts, rs, "0", "0%", "error", shape_msg])
    s = summarize(p)
    assert [r.module for r in s.divergent] == ["model.layers.1.mlp"]
    assert "squeezed" in s.rows[0].note and "fused" in s.rows[1].note


def test_statistics_weights_that_differ_are_rl_msprobes_finding(tmp_path: Path) -> None:
    """msprobe's statistics checkers pass a module's own weight (no input -> output rule covers
    it); a same-shape weight whose norm differs beyond round-off is marked, with rl-msprobe's
    own message. Seen on the live job: layer 1's post_attention_layernorm weight x4 on the
    rollout passed, and so did the norm's output behind vLLM's fused add-RMSNorm."""
    head = ["NPU Name", "Bench Name", "NPU Tensor Shape", "Bench Tensor Shape", "Max diff", "NormRelativeErr"]
    norm = "post_attention_layernorm.Qwen2RMSNorm"
    cases = [  # (layer, parameter, train shape, rollout shape, NormRelativeErr)
        (0, "parameters.weight", "[128]", "[128]", "0.39%"),  # bf16 against fp32: round-off
        (1, "parameters.bias", "[128, 128]", "[0]", "100%"),  # not dumped on one side: no finding
        (1, "parameters.weight", "[128]", "[128]", "75.0%"),
    ]
    p = tmp_path / "compare_result_4.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*head, "Result", "Err_message"])
        for layer, x, ts, rs, rel in cases:
            w.writerow(
                [
                    T.format(l=layer, m=norm, x=x),
                    R.format(l=layer, m=norm, x=x),
                    ts,
                    rs,
                    "-3",
                    rel,
                    "pass",
                    "[]",
                ]
            )
    s = summarize(p)
    assert [(r.layer, r.tensor) for r in s.divergent] == [(1, "parameters.weight")]
    first = s.first_divergence
    assert (
        first is not None
        and first.result == "error"
        and "rl-msprobe: the engines hold different weights" in first.message
    )

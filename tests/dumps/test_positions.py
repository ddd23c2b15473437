"""Whole-response consistency on real msprobe tensor dumps of one request (position_standin.py): a
vLLM-named tiny Qwen2 decoding with a KV cache against transformers' forward over prompt + response.
The plants multiply one module's output by 1.01 in decode steps only, or on prompt rows >= 3 of the
prefill only (issue 32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rl_msprobe.dumps import positions
from rl_msprobe.dumps.judge import Judgement
from rl_msprobe.errors import UserError
from tests.dumps.conftest import step_dumps, write_dump

PROMPT, RESPONSE = 8, 6  # position_standin.PROMPT / RESPONSE


def request(root: Path, train: Path) -> positions.Result:
    steps = [positions.read_forward(s[0]) for s in step_dumps(root)]
    return positions.compare_request(steps[0], steps[1:], positions.read_forward(step_dumps(train)[0][0]))


DECODE_PLANT = "model.layers.1.mlp.down_proj"  # what the stand-in's decode plants perturb


def _at(where: positions.Position, judged: Judgement) -> tuple[int, str, str, str]:
    """(first position, its phase, module, tensor) of a first divergence."""
    return (where.start, where.phase, judged.module, judged.tensor)


def test_from_dump_folders(position_dumps: dict[str, Path], tmp_path: Path) -> None:
    """compare_dumps takes the step folders as msprobe writes them (TP ranks merged on the way)."""
    folders = [[p.parent for p in s] for s in step_dumps(position_dumps["tp"])]
    train = step_dumps(position_dumps["train"])[0][0].parent
    r = positions.compare_dumps(folders[0], folders[1:], train, tmp_path)
    assert r.status == "consistent" and len(r.positions) == PROMPT + RESPONSE - 1, r.verdict()
    assert (tmp_path / "decode0" / "rollout" / "dump.json").is_file()
    with pytest.raises(UserError, match="no prefill dump given"):
        positions.compare_dumps([], [], train, tmp_path)


def test_clean_is_consistent_at_every_position(position_dumps: dict[str, Path]) -> None:
    r = request(position_dumps["clean"], position_dumps["train"])
    assert r.status == "consistent", r.verdict()
    assert [(p.start, p.phase) for p in r.positions] == [(i, "prefill") for i in range(PROMPT)] + [
        (PROMPT + k, "decode") for k in range(RESPONSE - 1)
    ]
    # every position judges the same modules: projections (fused qkv / gate_up met by their
    # training parts), norms, attention block, MLP, decoder layers, the head
    judged = {len(p.judgements) for p in r.positions}
    assert judged == {21}, judged
    modules = {j.module for j in r.positions[PROMPT].judgements}
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "lm_head"} <= modules
    assert max(j.error for p in r.positions for j in p.judgements) < 1e-5  # fp32 round-off only
    assert r.uncovered == [PROMPT + RESPONSE - 1]  # the last response token is never fed back
    assert r.verdict().startswith("CONSISTENT at every position: 13 position span(s)")
    # rollout: 21 of 29 modules (rotary, attention, SiluAndMul x 2 layers, Qwen2Model, logits
    # processor are not met); training: 27 of 30 (its rotary embedding and the two act_fn)
    assert r.coverage == pytest.approx(21 / 29)


def test_a_decode_only_divergence_is_found_at_the_first_response_position(
    position_dumps: dict[str, Path],
) -> None:
    r = request(position_dumps["decode_plant"], position_dumps["train"])
    assert r.status == "divergent"
    first = r.first
    assert first is not None
    where, j = first
    assert _at(where, j) == (PROMPT, "decode", DECODE_PLANT, "output.0")
    assert j.error == pytest.approx(0.01, rel=0.05) and j.floor_ratio > 50 and j.gain > 50
    assert all(p.first is None for p in r.positions[:PROMPT])  # the prefill is untouched
    assert all(p.first is not None and p.first.module == j.module for p in r.positions[PROMPT:])
    # what a prefill-only compare says about the same job: nothing
    prefill = positions.read_forward(step_dumps(position_dumps["decode_plant"])[0][0])
    only = positions.compare_request(
        prefill, [], positions.read_forward(step_dumps(position_dumps["train"])[0][0])
    )
    assert only.status == "consistent", only.verdict()
    assert only.verdict().startswith("CONSISTENT at every compared position: 8 position span(s)")
    assert only.verdict().endswith("training positions 8-13 have no rollout step (not compared)")
    assert "response position 0" in r.verdict() and "model.layers.1.mlp.down_proj" in r.verdict()


def test_decode_steps_in_statistics_mode_are_judged_per_position(position_dumps: dict[str, Path]) -> None:
    """The bounded-size choice: the prefill in tensor mode, each decode step in statistics mode
    (one token: its statistics are that position's), the training forward in tensor mode."""
    prefill = positions.read_forward(step_dumps(position_dumps["clean"])[0][0])
    decodes = [positions.read_forward(s[0]) for s in step_dumps(position_dumps["decode_plant_stats"])]
    assert [d.task for d in decodes] == ["statistics"] * (RESPONSE - 1)
    r = positions.compare_request(
        prefill, decodes, positions.read_forward(step_dumps(position_dumps["train"])[0][0])
    )
    first = r.first
    assert first is not None, r.verdict()
    where, j = first
    assert _at(where, j) == (PROMPT, "decode", DECODE_PLANT, "output.0")
    assert j.error == pytest.approx(0.01, rel=0.05)
    assert [p.start for p in r.positions if p.first] == list(range(PROMPT, PROMPT + RESPONSE - 1))
    # the modules before the plant are judged from statistics at every decode position, and clean
    before = [x for p in r.positions[PROMPT:] for x in p.judgements if x.layer == 0]
    assert before and all(not x.divergent and x.error < 1e-5 for x in before)


def test_a_prefill_only_divergence_is_found_inside_the_prompt(position_dumps: dict[str, Path]) -> None:
    r = request(position_dumps["prefill_plant"], position_dumps["train"])
    first = r.first
    assert first is not None
    where, j = first
    assert (where.start, where.phase, j.module) == (3, "prefill", "model.layers.0.self_attn.o_proj")
    assert [p.start for p in r.positions if p.first] == [3, 4, 5, 6, 7]


def test_different_token_ids_are_not_compared_naming_the_position(position_dumps: dict[str, Path]) -> None:
    r = request(position_dumps["clean"], position_dumps["train_flip"])
    assert r.status == "not compared" and not r.positions
    assert r.ids_mismatch and "position 10 " in r.ids_mismatch
    assert r.verdict().startswith("NOT COMPARED: the token ids differ at position 10")


def test_a_step_with_nothing_to_judge_is_not_compared(position_dumps: dict[str, Path]) -> None:
    """Consistent means judged at every position: a decode step that dumped only the embedding
    (its token ids) makes the request NOT COMPARED, naming that position."""
    steps = [positions.read_forward(s[0]) for s in step_dumps(position_dumps["clean"])]
    embed = {k: v for k, v in steps[2].data.items() if ".embed_tokens." in k}
    steps[2] = positions.Forward(steps[2].path, steps[2].task, embed)
    train = positions.read_forward(step_dumps(position_dumps["train"])[0][0])
    r = positions.compare_request(steps[0], steps[1:], train)
    embed_only = [p for p in r.positions if p.start == PROMPT + 1]
    assert embed_only and [j.module for j in embed_only[0].judgements] == ["model.embed_tokens"]
    steps[2] = positions.Forward(steps[2].path, steps[2].task, {k: v for k, v in embed.items()})
    # nothing but the ids: drop the embedding's output too
    key = next(iter(embed))
    steps[2].data[key] = {**embed[key], "output": []}
    r = positions.compare_request(steps[0], steps[1:], train)
    assert r.status == "not compared" and r.unjudged == [PROMPT + 1], r.verdict()
    assert r.verdict().startswith(f"NOT COMPARED: no module output could be judged at {PROMPT + 1} ")


def test_a_rollout_dump_cut_short_is_not_compared(position_dumps: dict[str, Path]) -> None:
    """A prefill dump that stops after its first layer (a crash) leaves most modules unmet."""
    steps = [positions.read_forward(s[0]) for s in step_dumps(position_dumps["clean"])]
    short = [
        positions.Forward(
            s.path,
            s.task,
            {
                k: v
                for k, v in s.data.items()
                if ".layers.1." not in k
                and "lm_head" not in k
                and ".norm." not in k
                and "logits" not in k
                and "Qwen2Model" not in k
                and ".mlp" not in k
            },
        )
        for s in steps
    ]
    r = positions.compare_request(
        short[0], short[1:], positions.read_forward(step_dumps(position_dumps["train"])[0][0])
    )
    assert r.status == "not compared" and r.coverage < 0.5, (r.coverage, r.verdict())
    assert r.verdict().startswith("NOT COMPARED: only ")


def test_a_tp2_rollout_is_merged_step_by_step_and_consistent(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    """Merged through another interpreter (`-I`: as when torch is not importable here, the
    training interpreter's): shards concatenated, and tensors read, by tensor_files there."""
    other = [sys.executable, "-I"]
    train = positions.read_forward(step_dumps(position_dumps["train"])[0][0])
    steps = []
    for n, ranks in enumerate(step_dumps(position_dumps["tp"])):
        assert [p.parent.name for p in ranks] == ["rank0", "rank1"]
        steps.append(positions.read_step(ranks, train, tmp_path / f"step{n}", other))
    r = positions.compare_request(steps[0], steps[1:], train)
    assert r.status == "consistent", r.verdict()
    files = sorted((steps[0].folder).glob("*.pt"))[:4]
    there, here = positions.load_arrays(other)(files), positions.load_arrays()(files)
    assert len(there) == 4 and all((there[f] == here[f]).all() for f in files)
    assert {len(p.judgements) for p in r.positions} == {21}  # lm_head's output found by shape
    # the same errors as the TP=1 rollout's, up to round-off
    one = request(position_dumps["clean"], position_dumps["train"])
    for a, b in zip(r.positions, one.positions):
        assert [j.module for j in a.judgements] == [j.module for j in b.judgements]
        assert max(abs(x.error - y.error) for x, y in zip(a.judgements, b.judgements)) < 1e-5


def test_the_layer_map_marks_where_the_divergence_starts(
    position_dumps: dict[str, Path], tmp_path: Path
) -> None:
    from rl_msprobe.dumps.position_report import logprob_gap, markdown, plot_map

    r = request(position_dumps["decode_plant"], position_dumps["train"])
    layers, grid = r.layer_map()
    assert layers == ["embed", "0", "1", "head"] and len(grid) == len(r.positions)
    assert grid[PROMPT][2] is not None and grid[PROMPT][2] > 50  # layer 1 at the first response position
    assert all(row[1] is not None and row[1] < 1 for row in grid)  # layer 0: noise everywhere
    png = tmp_path / "map.png"
    triage = tmp_path / "triage" / "123" / "triage.jsonl"
    triage.parent.mkdir(parents=True)
    line = {"step": 1, "request_id": "other", "rollout_log_probs": [0.0], "train_log_probs": [1.0]}
    ours = {
        **line,
        "request_id": "3f2a",
        "rollout_log_probs": [-1.0, -2.0, -0.5],
        "train_log_probs": [-1.0, -2.5, None],
    }
    triage.write_text(json.dumps(line) + "\n" + json.dumps(ours) + "\n")
    gap = logprob_gap(triage.parent.parent, "3f2a-0badc0de")  # the id vLLM suffixed
    assert gap is not None and gap[:2] == [0.0, 0.5] and gap[2] != gap[2]  # null: nan
    assert logprob_gap(triage.parent.parent, "nope") is None
    assert plot_map(r, png, logprob_gap=gap) is None and png.stat().st_size > 1000
    md = "\n".join(markdown(r, png.name))
    assert md.count("| divergent | model.layers.1.mlp.down_proj output.0 |") == RESPONSE - 1
    assert (
        "| position 8 (response position 0) | decode | divergent |" in md
        and "![position x layer map](map.png)" in md
    )
    doc = json.loads(json.dumps(r.to_json()))
    assert doc["first"]["start"] == PROMPT and doc["first"]["module"] == "model.layers.1.mlp.down_proj"


def test_a_training_dump_in_statistics_mode_is_refused(tmp_path: Path) -> None:
    doc = {"task": "statistics", "level": "L0", "data": {"Module.m.Linear.forward.0": {"input_args": []}}}
    train = positions.read_forward(write_dump(tmp_path / "t", doc))
    with pytest.raises(
        UserError, match="in statistics mode; .*per-token record .*DUMP_POSITIONS=1.* or a tensor-mode dump"
    ):
        positions.compare_request(train, [], train)

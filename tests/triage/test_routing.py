"""`mismatch report`'s MoE routing section, on routing records in the verl-routing helper's schema
(rl_msprobe/patches/files/verl/verl/utils/rl_msprobe_routing.py) written here beside triage lines:
the live job (tests/live/test_live_routing.py, full tier) shows the helper writing them on both
sides of a real verl + vLLM run; these cases cover what the CPU engine cannot run — routing
replay on (vLLM returns routed experts only on its V2 runner, which needs Triton; verl's FSDP
engine has no replay) — and near-ties, positions and the gap alignment, each against numbers
computed here from the same records."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rl_msprobe.triage.routing import read_routing
from tests.support.trees import run_cli
from tests.triage.test_report import write_log

LAYERS, EXPERTS, K = 3, 8, 2
SCHEMA = "rl-msprobe-routing/1"


def _route(rnd: random.Random) -> tuple[list[list[int]], list[float]]:
    experts = [rnd.sample(range(EXPERTS), K) for _ in range(LAYERS)]
    margins = [round(rnd.uniform(0.05, 0.5), 6) for _ in range(LAYERS)]
    return experts, margins


def write_routing(
    folder: Path, lines: list[dict], flip: dict | None = None, replay: str = "disabled"
) -> list:
    """Both sides' records for every triage line; FLIP {step, layer, every, tie} makes the rollout's
    layer differ at every EVERY-th response position of that step (a near-tie margin when TIE).
    Returns the (step, request id, position, layer) flipped."""
    rnd = random.Random(1)
    rollout, train, flipped = [], [], []
    call = {}
    for doc in lines:
        prompt, response = doc["prompt_ids"], doc["response_ids"]
        tokens = prompt + response
        call.setdefault(doc["step"], len(call) + 1)
        rows = [_route(rnd) for _ in tokens]
        t_rows = [([list(e) for e in ex], list(m)) for ex, m in rows]
        for j in range(len(response)):
            row = len(prompt) + j - 1
            if flip and doc["step"] == flip["step"] and j % flip["every"] == 0:
                layer = flip["layer"]
                ids = rows[row][0][layer]
                spare = next(e for e in range(EXPERTS) if e not in ids)
                rows[row][0][layer] = [ids[0], spare]
                if flip.get("tie"):
                    rows[row][1][layer] = 0.001
                flipped.append((doc["step"], doc["request_id"], j, layer))
        # the rollout never runs the last response token as an input: its rows stop one short
        n = len(tokens) - 1
        rollout.append(
            {
                "schema": SCHEMA,
                "side": "rollout",
                "layers": list(range(LAYERS)),
                "request_id": f"{doc['request_id']}-0123abcd",  # vLLM's suffix
                "positions": list(range(n)),
                "tokens": tokens[:n],
                "experts": [r[0] for r in rows[:n]],
                "margins": [r[1] for r in rows[:n]],
            }
        )
        train.append(
            {
                "schema": SCHEMA,
                "side": "train",
                "layers": list(range(LAYERS)),
                "call": call[doc["step"]],
                "tokens": tokens,
                "positions": list(range(len(tokens))),
                "experts": [r[0] for r in t_rows],
                "margins": [r[1] for r in t_rows],
            }
        )
    names = [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]
    head = {"schema": SCHEMA, "kind": "header", "layers": names, "top_k": K, "experts": EXPERTS}
    on = replay != "disabled"
    for pid, side, body, rep in (
        ("7", "rollout", rollout, {"return_routed_experts": on}),
        ("8", "train", train, {"mode": replay, "enabled": on, "rollout_experts_in_batch": on}),
    ):
        (folder / pid).mkdir(parents=True, exist_ok=True)
        docs = [{**head, "side": side, "replay": rep}, *body]
        (folder / pid / "routing.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return flipped


def test_identical_routing_agrees_everywhere_and_replay_on_held(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=2, per_step=6, jump_at=None)
    write_routing(folder, lines, replay="R3")
    routing = read_routing(folder)
    assert routing is not None
    tokens = sum(len(x["response_ids"]) for x in lines)
    assert sum(s.tokens for s in routing.steps.values()) == tokens  # every response token compared
    assert all(s.differ == 0 for s in routing.steps.values())
    assert routing.unmatched == {"rollout": 0, "train": 0}
    assert routing.replay_state() == "on, held"


def test_a_flipped_layer_is_named_with_its_share_positions_and_replay_not_held(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=3, per_step=6, jump_at=None)
    flipped = write_routing(folder, lines, flip={"step": 2, "layer": 1, "every": 3}, replay="R3")
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(tmp_path / "r"), "--json")
    assert code == 0, err
    doc = json.loads(out)["routing"]
    steps = {s["step"]: s for s in doc["steps"]}
    assert steps[1]["differ"] == steps[3]["differ"] == 0
    two = steps[2]
    want = [f for f in flipped if f[0] == 2]
    assert two["layers"]["1"]["differ"] == len(want) and two["layers"]["0"]["differ"] == 0
    assert two["layers"]["1"]["share_differ"] == pytest.approx(len(want) / two["tokens"])
    assert two["cause_layer"] == 1 and two["differ"] == len(want)
    assert two["flipped_positions"] == sorted({f[2] for f in want})
    assert doc["replay"]["state"] == "on, NOT held"
    md = (tmp_path / "r" / "report.md").read_text()
    assert (
        "## MoE routing" in md
        and "MoE routing differs from layer 1 (model.layers.1.mlp.gate) at step 2" in md
    )
    assert "replay is on but did not hold" in md
    assert "## MoE routing flips" in md and "| 2 | s2r" in md  # the flips of step 2, with their request ids


def test_near_ties_are_told_apart_and_replay_off_proposes_the_keys(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=2, per_step=6, jump_at=None)
    write_routing(folder, lines, flip={"step": 1, "layer": 2, "every": 4, "tie": True})
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(tmp_path / "r"), "--json")
    assert code == 0, err
    report = json.loads(out)
    one = {s["step"]: s for s in report["routing"]["steps"]}[1]
    assert one["layers"]["2"]["differ"] == one["layers"]["2"]["differ_near_tie"] > 0
    assert report["routing"]["replay"]["state"] == "off"
    notes = " ".join(report["proposal"]["notes"])
    assert "layer 2" in notes and "enable_rollout_routing_replay=True" in notes, notes


def test_gap_of_flipped_tokens_against_tokens_routed_alike(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=1, per_step=8, jump_at=None)
    flipped = write_routing(folder, lines, flip={"step": 1, "layer": 0, "every": 2})
    routing = read_routing(folder)
    assert routing is not None
    s = routing.steps[1]
    gaps = {
        (x["request_id"], j): abs(t - r)
        for x in lines
        for j, (r, t) in enumerate(zip(x["rollout_log_probs"], x["train_log_probs"]))
    }
    hit = {(f[1], f[2]) for f in flipped}
    want = sum(gaps[k] for k in hit) / len(hit)
    assert s.mean_dlogp(True) == pytest.approx(want)
    rest = [v for k, v in gaps.items() if k not in hit]
    assert s.mean_dlogp(False) == pytest.approx(sum(rest) / len(rest))


def test_a_broken_routing_line_is_bad_input_naming_file_and_line(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=1, per_step=2, jump_at=None)
    write_routing(folder, lines)
    path = folder / "7" / "routing.jsonl"
    path.write_text(path.read_text() + '{"side": "rollout", "positions": [1]}\n')
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(tmp_path / "r"))
    assert code == 2, (out, err)
    assert "routing.jsonl:4:" in err and not (tmp_path / "r").exists(), err


def test_a_dense_run_has_no_routing_section(tmp_path) -> None:
    folder = tmp_path / "triage"
    write_log(folder, steps=2, per_step=4)
    code, out, err = run_cli("mismatch", "report", str(folder), "--out", str(tmp_path / "r"), "--json")
    assert code == 0, err
    assert json.loads(out)["routing"] is None
    assert "MoE routing" not in (tmp_path / "r" / "report.md").read_text()


def test_a_triage_line_with_ids_that_are_not_numbers_is_left_out_of_routing(tmp_path) -> None:
    folder = tmp_path / "triage"
    lines = write_log(folder, steps=1, per_step=3, jump_at=None)
    write_routing(folder, lines)
    log = folder / "123" / "triage.jsonl"
    docs = [json.loads(x) for x in log.read_text().splitlines()]
    docs[0]["response_ids"] = ["x"] * len(docs[0]["response_ids"])
    log.write_text("".join(json.dumps(d) + "\n" for d in docs))
    routing = read_routing(folder)
    assert routing is not None and routing.requests == 2

"""`mismatch report` on triage lines with a distribution (schema rl-msprobe-triage/2), written as the
helper writes them: a clean step, a numeric step, a step whose rollout samples at temperature 0.8
while training is at 1.0, and a step whose rollout returns top-p 0.9 processed log-probs. The report
names each step's cause (markdown, HTML and --json) and proposes the key for the semantic ones."""

from __future__ import annotations

import json

import numpy as np

from tests.support.trees import run_cli
from tests.triage.test_report import SCRIPT, helper_module
from tests.triage.test_semantics import log_softmax, top_p_processed

K, V, N = 8, 64, 12
STEPS = {1: "clean", 2: "numeric", 3: "temperature", 4: "top_p"}


def line(helper, step, index, rng):
    z = rng.normal(0, 1.5, (N, V))
    train = log_softmax(z)
    rollout = {
        "clean": train,
        "numeric": log_softmax(z + rng.normal(0, 0.05, z.shape)),
        "temperature": log_softmax(z / 0.8),
        "top_p": top_p_processed(z, 0.9),
    }[STEPS[step]]
    sampled = np.array([rng.choice(V, p=np.exp(r) / np.exp(r).sum()) for r in rollout])
    rows = np.arange(N)
    rids = np.argsort(-rollout, axis=1, kind="stable")[:, :K]
    tids = np.argsort(-train, axis=1, kind="stable")[:, :K]
    take = np.take_along_axis
    doc = {
        "schema": "rl-msprobe-triage/2",
        "step": step,
        "index": index,
        "request_id": f"s{step}r{index}",
        "uid": f"u{index}",
        "prompt_len": 3,
        "distribution": {
            "k": K,
            "rollout_ids": rids.tolist(),
            "rollout": helper._Rows(take(rollout, rids, 1).tolist()),
            "train_at_rollout": helper._Rows(take(train, rids, 1).tolist()),
            "train_ids": tids.tolist(),
            "train": helper._Rows(take(train, tids, 1).tolist()),
            "lse": helper._Floats([0.0] * N),
            "entropy": helper._Floats((-(np.exp(train) * train).sum(1)).tolist()),
        },
        "prompt_ids": [1, 2, 3],
        "response_ids": sampled.tolist(),
        "rollout_log_probs": helper._Floats(rollout[rows, sampled].tolist()),
        "train_log_probs": helper._Floats(train[rows, sampled].tolist()),
    }
    return helper._dumps(doc)


def test_each_step_named_and_the_key_proposed(tmp_path):
    helper = helper_module()
    rng = np.random.default_rng(0)
    folder = tmp_path / "triage"
    (folder / "7").mkdir(parents=True)
    text = "".join(line(helper, step, i, rng) + "\n" for step in STEPS for i in range(4))
    (folder / "7" / "triage.jsonl").write_text(text)
    script = tmp_path / "run.sh"
    script.write_text(
        SCRIPT.replace("rollout.name=vllm", "rollout.name=vllm actor_rollout_ref.rollout.top_p=0.9")
    )
    code, out, err = run_cli("mismatch", "report", str(folder), "--script", str(script), "--json")
    assert code == 0, err + out
    doc = json.loads(out)
    dist = doc["distribution"]
    verdicts = {s["step"]: s["causes"] for s in dist["steps"]}
    assert verdicts == {1: [], 2: ["numerics"], 3: ["temperature"], 4: ["renormalisation"]}, verdicts
    clean = dist["steps"][0]
    assert clean["mean_kl_low"] < 1e-9 and clean["mean_top1"] == 1.0 and clean["min_position_top1"] == 1.0
    assert dist["steps"][1]["mean_kl_low"] > 1e-4
    causes = {c["cause"]: c for c in doc["causes"]}
    assert set(causes) == {"temperature", "renormalisation"}
    assert abs(causes["temperature"]["numbers"]["t_rollout_over_t_train"] - 0.8) < 1e-3
    assert causes["temperature"]["steps"] == [3] and causes["renormalisation"]["steps"] == [4]
    assert any("top_p=1.0" in f and "0.9" in f for f in causes["renormalisation"]["fix"])
    md = (folder / "report" / "report.md").read_text()
    assert "## Distribution per position" in md and "## Semantic causes" in md
    assert "**temperature** (step 3)" in md and "actor_rollout_ref.rollout.temperature" in md
    html = (folder / "report" / "report.html").read_text()
    assert "Semantic causes" in html
    code, out, err = run_cli("mismatch", "report", str(folder), "--script", str(script))
    assert "cause: temperature" in out and "next: fix the semantic cause(s)" in out, out


def test_old_lines_have_no_distribution_sections(tmp_path):
    from tests.triage.test_report import write_log

    folder = tmp_path / "triage"
    write_log(folder, steps=2, per_step=3, jump_at=None)
    code, out, err = run_cli("mismatch", "report", str(folder), "--json")
    doc = json.loads(out)
    assert doc["distribution"] is None and doc["causes"] == []
    assert "Distribution per position" not in (folder / "report" / "report.md").read_text()

"""Consistency mode on a REAL verl 0.9.1 GRPO job whose rollout is SGLang 0.5.12
(``actor_rollout_ref.rollout.name=sglang``): in-process Ray, FSDP2 actor, verl's SGLang server
rollout (HYBRID mode: the server in a Ray actor, its scheduler in a spawned subprocess), the real
weight sync (``update_weights_from_tensor``), tiny Qwen2, fp32, 1 rank. The job and its CPU needs:
tests/support/sglang_job.py; the venv: tests/support/sglang_job_venv.py.

All through the CLI with ``--python <user venv>`` (copies of verl and sglang, so the shared venv is
never edited): env -> detect --hint -> prepare --mode consistency (the plan that keeps the job:
per-token records on both sides, the user's batch of 2 prompts x n 2) -> patch apply <exactly the
sets prepare prints: verl-consistency, sglang-dispatch-log, and with --weights verl-weights,
sglang-weights> -> the derived script, unchanged -> dumps positions on the records -> patch revert
-> site-packages byte-identical.

ONE job, 2 training steps, the live vLLM job's assertions (tests/live/test_consistency_job.py) on
SGLang: every request recorded on both sides, step 1 CONSISTENT at every position of every
request, step 2 with a 1% fault planted in one module's output on the rollout side only (in
SGLang's scheduler after the weight sync; tests/support/sglang_plant_hook.py), named at that module
from position 0.

HYBRID sleep / wake runs too (``free_cache_engine=True``): SGLang's scheduler releases weights and
KV cache after each rollout and resumes them around each sync (noted by the plant hook).

Wall time (2 cores shared with 4 other sessions, 2026-12-02; the venv, ~3-4 min cold, not counted):
the job 167 s and 308 s (load of other live tests), compares 24 s and 48 s, the module fixture
245 s and 448 s (user venv copy, CLI, job, compares, revert); the tests on its results < 1 s
each. The plain job alone (python -m tests.support.sglang_job DIR): 147 s. With `--weights` (the
weight fingerprints on both trees, one more test): the job 230 s and 165 s, the fixture 367 s and
254 s (2026-12-02, load 6-7 and ~4): no measurable cost beyond the load's swing; `weights compare`
< 1 s. On merged main at 02:44 (lighter load): the job 118 s, compares 13 s, fixture and the
8 tests 177 s. The records plan (2026-12-07): 8 requests on both sides, the 4 of step 1 CONSISTENT at
every position (SGLang also runs the forward of the token that ends a request, so every training
position has a rollout row), the 4 of step 2 DIVERGENT at the planted module from position 0; the
module 78 s (the job ~60 s, `dumps positions` 2 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tests.live.test_consistency_job import as_json, ok
from tests.support import sglang_job
from tests.support.user_venv import user_venv
from tests.support.vllm_cpu import site_packages, tree_digest

pytestmark = [pytest.mark.e2e, pytest.mark.full]  # the full tier: a live job the default tier does not run

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
STEPS = 2
PLANT = {"sync": 2, "module": "model.layers.0.mlp.down_proj", "scale": 1.01, "tp_rank": None}
TREES = ("verl", "sglang")


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "rl_msprobe", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@dataclass
class Flow:
    result: object  # live_job.JobResult
    prepared: str  # prepare's output
    sets: list[str]
    script: Path  # the derived script
    dump: Path  # records/ and weights/
    positions: tuple[subprocess.CompletedProcess, dict]  # `dumps positions --json` on the records
    plant_log: list[dict] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # site-packages files that differ after revert
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> Flow:
    root = tmp_path_factory.mktemp("sglang-rollout")
    job = sglang_job.prepare_job(root / "job", steps=STEPS)  # skips loudly without the venv
    seconds: dict[str, float] = {}
    started = time.monotonic()
    python = user_venv(root / "user-venv", job.python, TREES, ("verl-", "sglang-"))
    site = site_packages(python)
    before = tree_digest(site)
    ok(cli("env", "--python", str(python)))
    assert "consistency" in ok(
        cli("detect", str(job.script), "--hint", "训推一致性: prefill 对齐 rollout vs actor")
    )
    prepared = ok(
        cli(
            "prepare",
            str(job.script),
            "--mode",
            "consistency",
            "--weights",
            "--steps",
            str(STEPS),
            "--python",
            str(python),
        )  # fmt: skip
    )
    sets = [
        s
        for line in re.findall(r"rl-msprobe patch apply ((?:\S+ )+?)--python", prepared)
        for s in line.split()
    ]
    script = job.root / f"run_consistency_{job.script.stem.removeprefix('run_')}.sh"
    dump = job.root / f"msprobe_{job.script.stem.removeprefix('run_')}" / "dump"
    plant_dir = root / "plant"
    plant_dir.mkdir()
    shutil.copyfile(SUPPORT / "live_plant.py", plant_dir / "live_plant.py")
    shutil.copyfile(SUPPORT / "sglang_plant_hook.py", plant_dir / "sitecustomize.py")
    plant_log = root / "plant.jsonl"
    ok(cli("patch", "apply", *sets, "--python", str(python)))
    try:
        t0 = time.monotonic()
        result = sglang_job.run(
            replace(job, python=python),  # the derived script's python3 is the user's
            script,
            pythonpath=(plant_dir,),
            RL_MSPROBE_PLANT=json.dumps([PLANT]),
            RL_MSPROBE_PLANT_LOG=str(plant_log),
        )
        seconds["job"] = result.wall_s
        t0 = time.monotonic()
        proc = cli("dumps", "positions", str(dump / "records"), "--out", str(root / "positions"), "--json")
        run = Flow(result, prepared, sets, script, dump, (proc, as_json(proc)), seconds=seconds)
        seconds["positions"] = time.monotonic() - t0
    finally:
        reverted = cli("patch", "revert", *sets, "--python", str(python))
    ok(reverted)
    after = tree_digest(site)
    run.changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    run.plant_log = [json.loads(x) for x in plant_log.read_text().splitlines()] if plant_log.exists() else []
    shutil.rmtree(root / "user-venv", ignore_errors=True)
    seconds["total"] = time.monotonic() - started
    print(f"live sglang consistency: {run.positions[1].get('verdict', run.positions[1])}")
    print(f"live sglang consistency flow (s): {json.dumps({k: round(v) for k, v in seconds.items()})}")
    return run


def _ran(run: Flow) -> None:
    assert run.result.returncode == 0, run.result.tail()
    assert sorted(run.result.metrics)[-1] == STEPS, run.result.metrics


def _positions(run: Flow) -> dict:
    proc, doc = run.positions
    assert "error" not in doc and proc.returncode in (0, 1), doc
    assert doc["source"] == "records", doc.get("source")
    return doc


def _steps_of(run: Flow) -> dict[str, int]:
    """Request id -> its training step: the number of weight syncs (the plant log) before its first
    rollout record (sync k precedes the rollout of step k)."""
    syncs = sorted(e["time"] for e in run.plant_log if "sync" in e)
    first: dict[str, float] = {}
    for path in (run.dump / "records" / "rollout").glob("*/rec*.json"):
        header = json.loads(path.read_text())
        for rid in header["requests"]:
            first[rid] = min(first.get(rid, header["timestamp"]), header["timestamp"])
    return {rid: sum(t > s for s in syncs) for rid, t in first.items()}


def test_prepare_asks_what_an_sglang_rollout_needs(flow: Flow) -> None:
    """The records plan on SGLang: the dispatch-log set records the rollout side, the radix cache off,
    the user's batch kept; verl's consistency set on the actor; --weights adds the weight
    fingerprints on both trees."""
    assert flow.sets == ["verl-consistency", "sglang-dispatch-log", "verl-weights", "sglang-weights"], (
        flow.prepared
    )
    derived = flow.script.read_text()
    assert "++actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache=True" in derived
    assert "RL_MSPROBE_RECORD_DIR=" in derived
    assert "max_num_seqs=1 " not in derived and "data.train_batch_size=2" in derived


def test_the_job_ran_every_step_with_a_real_weight_sync(flow: Flow) -> None:
    _ran(flow)
    log = flow.result.log
    assert "SGLang http server: rollout_mode=<RolloutMode.HYBRID" in log
    # the weight sync is real: the rollout's log-probs agree with the actor's after it
    for step in range(1, STEPS + 1):
        assert flow.result.metrics[step]["training/rollout_probs_diff_mean"] < 0.05, flow.result.metrics[step]
    # one sync per step, in SGLang's scheduler
    syncs = [e["sync"] for e in flow.plant_log if "sync" in e]
    assert syncs[:STEPS] == list(range(1, STEPS + 1)), flow.plant_log
    # HYBRID sleep / wake in SGLang's scheduler: weights and KV cache released after each rollout, resumed
    memory = [(e["memory"], tuple(e["tags"] or ())) for e in flow.plant_log if "memory" in e]
    assert ("release", ("kv_cache", "weights")) in memory, memory
    assert {tag for event, tags in memory if event == "resume" for tag in tags} == {"kv_cache", "weights"}, (
        memory
    )


def test_weights_are_equal_at_every_sync_with_every_tensor_accounted_for(flow: Flow) -> None:
    """`--weights` on the same job (issue 22): verl's engine_workers fingerprints what the actor
    sends, SGLang 0.5.12's ModelRunner.update_weights_from_tensor (patched by sglang-weights) what
    its scheduler receives bucket by bucket and holds; the fault this job plants is in a module's
    output, not in the weights, so every sync must be EQUAL."""
    _ran(flow)
    proc = cli("weights", "compare", str(flow.dump / "weights"), "--json")
    doc = as_json(proc)
    assert proc.returncode == 0 and doc["verdict"] == "EQUAL", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(doc["steps"]) >= STEPS, doc["steps"]  # a sync per training step (and the first one)
    for step in doc["steps"]:
        assert step["verdict"] == "EQUAL" and step["tp_size"] == 1, step
        assert step["sent_tensors"] == step["model_tensors"] > 0, step
        assert step["resident_how"] == {"parameter": step["model_tensors"] - step["counts"]["tied"]}, step


def test_every_request_is_recorded_on_both_sides(flow: Flow) -> None:
    _ran(flow)
    doc = _positions(flow)
    steps = _steps_of(flow)
    assert sorted(steps.values()) == [s for s in range(1, STEPS + 1) for _ in range(4)], steps
    assert {r["request_id"] for r in doc["requests"]} == set(steps)
    assert not any(doc["records"]["only_on"].values()), doc["records"]
    headers = [json.loads(p.read_text()) for p in (flow.dump / "records" / "rollout").glob("*/rec*.json")]
    assert {h["engine"] for h in headers} == {"sglang"}
    assert any(len(h["requests"]) >= 2 for h in headers)  # forward passes of several requests


def test_identical_weights_are_consistent_at_every_position(flow: Flow) -> None:
    steps = _steps_of(flow)
    clean = [r for r in _positions(flow)["requests"] if steps[r["request_id"]] == 1]
    assert len(clean) == 4
    for r in clean:
        assert r["status"] == "consistent" and r["verdict"].startswith("CONSISTENT at every position"), r[
            "verdict"
        ]
        pos = r["positions"]
        # the prompt row by row, then every response position (SGLang also runs the forward of the token
        # that ends the request; vLLM never feeds it back)
        starts = [p["start"] for p in pos["positions"]]
        assert starts in (list(range(pos["train_tokens"] - 1)), list(range(pos["train_tokens"]))), starts


def test_planted_one_percent_fault_is_found_at_that_module(flow: Flow) -> None:
    assert any(PLANT["module"] in e.get("active", {}) for e in flow.plant_log), flow.plant_log
    steps = _steps_of(flow)
    planted = [r for r in _positions(flow)["requests"] if steps[r["request_id"]] == PLANT["sync"]]
    assert len(planted) == 4
    for r in planted:
        first = r["positions"]["first"]
        assert r["status"] == "divergent" and first is not None, r["verdict"]
        assert (first["start"], first["module"], first["tensor"]) == (0, PLANT["module"], "output.0"), r[
            "verdict"
        ]


def test_revert_leaves_verl_and_sglang_byte_identical(flow: Flow) -> None:
    assert flow.changed == [], flow.changed[:20]

"""Consistency mode on a REAL verl 0.9.1 GRPO job (in-process Ray, FSDP2 actor, vLLM CPU server
rollout, real TransferQueue 0.1.11), from the plain user launch script, as a user would run it.

The user's venv is the shared job venv seen through a small venv of its own
(``tests/support/user_venv.py``): its site-packages holds copies of ``verl`` and ``vllm`` (what ``patch apply``
edits) and reaches every other package of the job venv through a ``.pth`` line. So the patches
go into the tree that actually runs, and the shared job venv that other tests use is never
edited. The flow, all through the CLI with ``--python <user venv>``:

  env -> detect --hint -> prepare --mode consistency -> patch apply <exactly the sets prepare
  prints> -> the derived script, unchanged -> dumps check / correlate / compare -> patch revert
  -> the user venv's site-packages byte-identical.

The same prepared job runs twice (one patch cycle): as prepared (identical fp32 weights on both
sides after the weight sync) and with one decoder layer's RMSNorm weight perturbed on the
rollout side only, after every weight sync, by test-only code run in the vLLM worker
(``live_job``'s ``after_weight_sync`` hook). Wall times (2 cores shared with other sessions,
2026-11-30): one job 8-9 min (520 s measured; ~7 min on a quiet machine), the whole fixture 38 min
of which most was waiting for the machine-wide live-job lock (16 + 18 min from `run` call to end,
user venv 17 s, compare ~30 s per run); the tests on its results take < 1 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.support import live_flow, live_job
from tests.support.user_venv import user_venv
from tests.support.vllm_cpu import site_packages, tree_digest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
PLANTED_LAYER = 1  # the tiny Qwen2 has layers 0 and 1: layer 0 stays consistent
PLANT_MODULE = "rl_msprobe_plant"
PLANT = f'''"""Test-only: perturb one decoder layer of the ROLLOUT model after each weight sync."""
import json, os, torch

LAYER = {PLANTED_LAYER}


def after_weight_sync(worker):
    norm = worker.model_runner.model.model.layers[LAYER].input_layernorm
    with torch.no_grad():
        norm.weight.mul_(1.5)
    with open(os.environ["RL_MSPROBE_PLANT_LOG"], "a") as log:
        log.write(json.dumps({{"pid": os.getpid(), "layer": LAYER, "mean": norm.weight.float().mean().item()}}) + "\\n")
'''


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`rl-msprobe ARGS` as a user runs it: a process of the tool's own interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "rl_msprobe", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"{proc.args}\nexit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


@dataclass
class Run:
    result: live_job.JobResult
    dump: Path  # prepare's dump root: generate/ and actor/
    check: subprocess.CompletedProcess
    correlate: dict
    compare: dict
    compare_proc: subprocess.CompletedProcess


@dataclass
class Flow:
    detect: str
    prepare: str
    sets: list[str]
    derived: str
    applied: str
    runs: dict[str, Run]
    revert: str
    identical: bool
    changed_files: list[str]
    plant_log: list[dict]
    seconds: dict[str, float]


def _sets_from(prepare_out: str) -> list[str]:
    """The sets of the `patch apply SET... --python PY` lines prepare printed (one line per --python)."""
    lines = re.findall(r"rl-msprobe patch apply ((?:\S+ )+?)--python", prepare_out)
    return [name for names in lines for name in names.split()]


def _after_run(python: Path, dump: Path, out: Path) -> tuple:
    correlate = json.loads(
        ok(cli("dumps", "correlate", str(dump / "generate"), str(dump / "actor"), "--json"))
    )
    check, compare, proc = live_flow.check_and_compare(dump, python, out)
    return check, correlate, compare, proc


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> Flow:
    root = tmp_path_factory.mktemp("live-consistency")
    job = live_job.prepare_job(root / "job", steps=STEPS)  # skips loudly without the job venv
    seconds: dict[str, float] = {}
    started = time.monotonic()
    python = user_venv(root / "user-venv", job.python)
    site = site_packages(python)
    seconds["user_venv"] = time.monotonic() - started
    before = tree_digest(site)
    user_job = replace(job, python=python)  # the derived script's python3 is the user's

    ok(cli("env", "--python", str(python)))
    detect = ok(cli("detect", str(job.script), "--hint", "训推一致性: prefill 对齐 rollout vs actor"))
    prepare = ok(cli("prepare", str(job.script), "--mode", "consistency", "--python", str(python)))
    sets = _sets_from(prepare)
    derived = job.root / f"run_consistency_{job.script.stem.removeprefix('run_')}.sh"
    assert derived.is_file(), prepare
    # the planted run: the same job prepared into another folder (its own configs and dumps)
    planted_dir = job.root / "planted"
    ok(
        cli(
            "prepare",
            str(job.script),
            "--mode",
            "consistency",
            "--python",
            str(python),
            "--out",
            str(planted_dir),
        )
    )
    planted = planted_dir / derived.name
    applied = ok(cli("patch", "apply", *sets, "--python", str(python)))  # as printed: one command, both trees
    plant_dir = root / "plant"
    plant_dir.mkdir()
    (plant_dir / f"{PLANT_MODULE}.py").write_text(PLANT)
    plant_log = root / "plant.jsonl"
    runs: dict[str, Run] = {}
    try:
        for name, script, extra in (
            ("consistent", derived, {}),
            (
                "planted",
                planted,
                {
                    "pythonpath": (plant_dir,),
                    "worker_modules": (PLANT_MODULE,),
                    "RL_MSPROBE_PLANT_LOG": str(plant_log),
                },
            ),
        ):
            t0 = time.monotonic()
            result = live_job.run(user_job, script, **extra)
            seconds[name] = time.monotonic() - t0
            dump = script.parent / f"msprobe_{job.script.stem.removeprefix('run_')}" / "dump"
            runs[name] = Run(result, dump, *_after_run(python, dump, root / f"compare-{name}"))
    finally:
        reverts = [cli("patch", "revert", *sets, "--python", str(python))]
    after = tree_digest(site)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    shutil.rmtree(root / "user-venv", ignore_errors=True)  # ~530 MB; pytest keeps 3 tmp roots
    log = [json.loads(line) for line in plant_log.read_text().splitlines()] if plant_log.exists() else []
    seconds["total"] = time.monotonic() - started
    for name, run in runs.items():  # what a run showed, for the docstring and the lead
        seconds[f"{name}_job"] = run.result.wall_s  # the job alone, not the wait for the lock
        print(f"live consistency {name}: {run.compare.get('verdict', run.compare)}")
    print(f"live consistency flow (s): {json.dumps({k: round(v) for k, v in seconds.items()})}")
    return Flow(
        detect,
        prepare,
        sets,
        derived.read_text(),
        applied,
        runs,
        "".join(ok(r) for r in reverts),
        before == after,
        changed,
        log,
        seconds,
    )


def test_prepare_asks_for_the_sets_and_aligns_the_actor_dtype(flow: Flow) -> None:
    assert "consistency" in flow.detect
    assert flow.sets and flow.sets[0] == "verl-consistency" and "vllm-dump" in flow.sets
    # the rollout runs fp32 here: the actor's FSDP forward must too (param_dtype defaults to bf16)
    assert "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32" in flow.derived


def test_the_job_runs_to_its_end_over_two_dumped_steps(flow: Flow) -> None:
    run = flow.runs["consistent"]
    assert run.result.returncode == 0, run.result.tail()
    assert sorted(run.result.metrics)[-1] == STEPS, run.result.metrics  # every configured step, then exit 0
    assert run.check.returncode == 0, run.check.stdout + run.check.stderr
    pairs = run.correlate["pairs"]
    train_steps = sorted({p["train"]["step"] for p in pairs})
    assert len(pairs) >= 2 and len(train_steps) >= 2, run.correlate
    # every prefill of the dumped steps is paired: one prompt per training step (batch 1, n 1)
    prefills = [
        json.loads(line)
        for log in sorted((run.dump / "generate").rglob("dispatch_log.jsonl"))
        for line in log.read_text().splitlines()
    ]
    prefills = [line for line in prefills if line["phase"] == "prefill"]
    assert len(prefills) == STEPS and len(pairs) == len(prefills), (prefills, pairs)


def test_identical_weights_compare_consistent_with_matched_rows(flow: Flow) -> None:
    run = flow.runs["consistent"]
    compare = run.compare
    assert run.compare_proc.returncode == 0, compare
    assert compare["consistent"] and compare["verdict"].startswith("CONSISTENT"), compare["verdict"]
    matched = [p["summary"]["matched_rows"] for p in compare["pairs"]]
    assert len(matched) >= 2 and all(n > 0 for n in matched), matched
    assert re.search(r"[1-9]\d* matched row", compare["verdict"]), compare["verdict"]


def test_a_layer_perturbed_on_the_rollout_side_is_found(flow: Flow) -> None:
    run = flow.runs["planted"]
    assert run.result.returncode == 0, run.result.tail()
    assert flow.plant_log and all(e["layer"] == PLANTED_LAYER for e in flow.plant_log)  # the hook ran
    compare = run.compare
    assert run.compare_proc.returncode == 1 and not compare["consistent"], compare.get("verdict", compare)
    assert compare["verdict"].startswith("DIVERGENT"), compare["verdict"]
    for pair in compare["pairs"]:
        first = pair["summary"]["first_divergence"]
        assert first is not None and f"layers.{PLANTED_LAYER}." in first["module"], first
        assert first["layer"] == PLANTED_LAYER, first  # nothing before that layer diverges
    assert f"layers.{PLANTED_LAYER}." in compare["verdict"]


def test_revert_leaves_the_venv_byte_identical(flow: Flow) -> None:
    assert flow.identical, flow.changed_files[:20]

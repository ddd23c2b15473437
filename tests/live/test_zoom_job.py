"""The zoom on a REAL verl 0.9.1 GRPO job (full tier): from the plain launch script to the operator.

The user's path, all through the CLI with ``--python <user venv>`` (tests/support/user_venv.py):

  prepare --mode consistency --steps 2 -> patch apply -> the derived script (per-token records of
  every request on both sides) -> dumps positions --json (the first divergence: request, position,
  module) -> prepare --mode consistency --zoom <that report> --steps 2 -> the zoomed script
  (msprobe mix dumps of the divergent layer's block, the divergent request only, its prompt's
  forward on both sides) -> dumps zoom <the zoom's dump folder>: msprobe's compare of the two
  zoomed dumps names the operator inside the module -> patch revert.

The fault (test-only code in the vLLM worker, tests/support/live_plant.py, ``"op": "silu"``): at
step 2, inside layer 0's ``mlp.act_fn`` on the rollout side, ``torch.nn.functional.silu`` returns
its output x1.01 — an operator that computes differently, what a different kernel does. Its input
(the gate projection's rows) agrees on both sides, so the zoom must name ``Functional.silu`` in
layer 0's mlp. Both runs reach the same request: the verl-consistency set sends stable request
ids (rl_msprobe_consistency.stable_request_id), the same in the second run of the same steps.

vLLM's CPU build runs linear layers and attention as its own ops (``torch.ops._C``), which msprobe
does not see; its activation (``SiluAndMul.forward_native``) is ``F.silu`` and a multiplication on
both engines, so the operator is one both dumps hold. On an accelerator the linear calls are
``torch.nn.functional.linear`` and show too.

One rank (TP 1), 2 steps, two jobs. Measured 2026-12-08 (2 cores, four other sessions' tests beside
it, load 10-15): 4 passed, the fixture 648 s (both jobs, the CLI, the compare). `dumps zoom` named
`Functional.silu.0.forward` in `Module.model.layers.0.mlp.act_fn.SiLUActivation.forward.0`, its output
0.99% off, its input 5.9e-7; the zoomed run recorded the same request ids as the first.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.live.test_consistency_job import PLANT_MODULE, PLANT_SOURCE, as_json, cli, ok
from tests.support import live_job
from tests.support.user_venv import user_venv
from tests.support.vllm_cpu import site_packages, tree_digest

pytestmark = [pytest.mark.e2e, pytest.mark.full]

STEPS = 2
PLANT = {"sync": 2, "module": "model.layers.0.mlp.act_fn", "scale": 1.01, "op": "silu"}


@dataclass
class Zoom:
    positions: dict  # `dumps positions --json` of the records run
    zoom_prepare: dict  # `prepare --zoom ... --json`
    front: dict  # `dumps compare <zoom dump> --json`
    records_ids: set[str]  # request ids recorded in the first run
    zoom_ids: set[str]  # ... and in the zoomed run
    zoom_dump: Path
    identical: bool  # the user venv's site-packages byte-identical after patch revert
    results: tuple[live_job.JobResult, live_job.JobResult]


def _ids(records: Path) -> set[str]:
    found: set[str] = set()
    for header in records.rglob("rec*.json"):
        found.update(json.loads(header.read_text()).get("requests", []))
    return found


@pytest.fixture(scope="module")
def zoom(tmp_path_factory) -> Zoom:
    root = tmp_path_factory.mktemp("live-zoom")
    job = live_job.prepare_job(root / "job", steps=STEPS)  # skips loudly without the job venv
    python = user_venv(root / "user-venv", job.python)
    site = site_packages(python)
    before = tree_digest(site)
    first = as_json(
        cli(
            "prepare", str(job.script), "--mode", "consistency", "--steps", str(STEPS),
            "--python", str(python), "--out", str(root / "records"), "--json",
        )
    )  # fmt: skip
    assert first.get("written"), first
    sets = first["patch_sets"]
    ok(cli("patch", "apply", *sets, "--python", str(python)))
    plant_dir = root / "plant"
    plant_dir.mkdir()
    shutil.copyfile(PLANT_SOURCE, plant_dir / f"{PLANT_MODULE}.py")
    user_job = replace(job, python=python)
    env = {"RL_MSPROBE_PLANT": json.dumps([PLANT]), "RL_MSPROBE_PLANT_LOG": str(root / "plant.jsonl")}
    try:
        one = live_job.run(
            user_job, Path(first["script"]), pythonpath=(plant_dir,), worker_modules=(PLANT_MODULE,), **env
        )
        assert one.returncode == 0, one.tail()
        records = next(p for p in (root / "records").rglob("records") if p.is_dir())
        report = root / "positions.json"
        proc = cli("dumps", "positions", str(records), "--out", str(root / "positions"), "--json")
        positions = as_json(proc)
        report.write_text(json.dumps(positions))
        zoomed = as_json(
            cli(
                "prepare", str(job.script), "--mode", "consistency", "--zoom", str(report),
                "--steps", str(STEPS), "--python", str(python), "--out", str(root / "zoom"), "--json",
            )
        )  # fmt: skip
        assert zoomed.get("written"), zoomed
        extra = [s for s in zoomed["patch_sets"] if s not in sets]
        if extra:
            ok(cli("patch", "apply", *extra, "--python", str(python)))
            sets += extra
        two = live_job.run(
            user_job, Path(zoomed["script"]), pythonpath=(plant_dir,), worker_modules=(PLANT_MODULE,), **env
        )
        assert two.returncode == 0, two.tail()
        zoom_dump = next(p for p in (root / "zoom").rglob("dump") if p.is_dir())
        front = as_json(cli("dumps", "zoom", str(zoom_dump), "--json"))
        print(f"live zoom: {json.dumps(front)[:2000]}")
    finally:
        ok(cli("patch", "revert", *sets, "--python", str(python)))
    identical = tree_digest(site) == before
    shutil.rmtree(root / "user-venv", ignore_errors=True)
    return Zoom(
        positions, zoomed, front, _ids(records), _ids(zoom_dump / "records"), zoom_dump, identical, (one, two)
    )


def test_the_records_find_the_fault_in_layer_0s_mlp_at_step_2(zoom: Zoom) -> None:
    """The records run: the requests of step 2 diverge first in layer 0's mlp (the silu inside it); the
    requests of step 1 are consistent."""
    doc = zoom.positions
    assert doc.get("status") == "divergent", json.dumps(doc)[:3000]
    firsts = [r["positions"]["first"] for r in doc["requests"] if r["status"] == "divergent"]
    assert firsts and all(".layers.0.mlp" in f["module"] for f in firsts), firsts
    assert any(r["status"] == "consistent" for r in doc["requests"]), [r["verdict"] for r in doc["requests"]]


def test_the_rerun_reaches_the_same_requests(zoom: Zoom) -> None:
    """Stable request ids: the zoomed run of the same steps sends the same ids, so the report's
    request is among them (verl's own ids are a fresh uuid each run)."""
    assert zoom.records_ids and zoom.records_ids <= zoom.zoom_ids | zoom.records_ids
    assert all(re.fullmatch(r"rlm[0-9a-f]{16}n[0-9]+", rid) for rid in zoom.records_ids)
    assert zoom.zoom_ids == zoom.records_ids, (sorted(zoom.records_ids), sorted(zoom.zoom_ids))


def test_the_zoom_names_the_operator_inside_the_module(zoom: Zoom) -> None:
    """`dumps zoom` on the zoomed run: msprobe's compare of the two mix-level dumps names F.silu, in
    layer 0's mlp, about 1% off while its input agrees."""
    op = zoom.front.get("operator")
    assert op is not None, json.dumps(zoom.front)[:4000]
    assert op["api"] == "Functional.silu" and ".layers.0.mlp" in (op["module"] or ""), op
    assert 0.005 < op["rel_error"] < 0.02 and op["input_error"] <= 1e-3, op


def test_revert_leaves_the_user_venv_as_it_was(zoom: Zoom) -> None:
    assert zoom.identical

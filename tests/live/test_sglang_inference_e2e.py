"""Inference mode on a live SGLang CPU engine, both code shapes, from a plain launch script through
the CLI: `detect`, `prepare --mode inference --backend sglang --python PY`, `patch apply` of what
prepare printed, the engine the derived command implies (tests/support/sglang_live.py), `dumps
check` on what it wrote, `patch revert` and a byte-identical sglang tree.

- SGLang 0.5.10.post1 (``patch``), with `data_parallel_size=2`: prepare prints `sglang-dump`;
  the derived command gives the rollout MSPROBE_ROLLOUT_CONFIG; the dumps come from the patched
  ModelRunner of each spawned scheduler process (the engine's main process never imports
  msprobe), one `rank{R}` per DP replica (rank_id=gpu_id: both replicas are rank 0 of their own
  TP group). verl itself passes `tp_size = tp x dp` for DP attention, a GPU path; here each
  replica has TP 1.
- SGLang 0.5.23 (``native``): prepare prints no dump set; the derived command passes
  `engine_kwargs.sglang.msprobe_dump_config`, which SGLang itself reads; `sglang-dump` is refused.
  The same engine also carries `prepare --weights` (issue 22): prepare prints `verl-weights` (the
  actor's tree) and `sglang-weights` (applied here), the derived command gives the engine
  RL_MSPROBE_WEIGHTS_DIR, and after the generation three weight syncs run through the engine's
  real `update_weights_from_tensor` (WeightUpdater in 0.5.23), 3 buckets each, the actor's
  tensors fingerprinted as sent by the same helper: as sent, one tensor scaled x1.001 inside the
  load (SGLang's own custom weight loader) and one after it was sent; `weights compare` must say
  EQUAL for the first and name exactly each planted tensor and stage. (The patch shape's engine
  runs DP=2, where SGLang refuses update_weights_from_tensor: its ModelRunner shape is proven by
  the release matrix, tests/patches/test_weights_releases.py.)

One engine per shape (module-scoped), its dumps reused by every check. Measured here (2 cores
shared with four other sessions, load 10-18, 2026-12-01): the whole module 426 s warm (`-m e2e`,
9 passed): the patch shape (DP=2) 217-224 s (CLI steps, engine start, 4 dumped forwards per
replica, revert), the native shape 165-227 s, the refusal check 7-9 s; cold, add the venv builds
(tests/support/sglang_venv.py: 204 s and 801 s under that load). The weight syncs ride on the
native engine (no engine of their own; loading the actor's tensors, three 3-bucket syncs, one
`weights compare`): 2026-12-02, load 7-8, the whole module 476 s (11 passed: patch shape 257 s,
native shape with the weight syncs 213 s, within the 165-227 s it took without them); the native
shape alone 122 s on a quieter machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import live_flow, sglang_live, vllm_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
STEPS = (0, 1, 2, 3)  # per rank: the prefill(s), then decode steps
# data parallel size per shape: the patch shape runs two DP replicas (rank_id=gpu_id per replica:
# without it both would write rank0), the native shape one; one engine start each
DP = {"patch": 2, "native": 1}
EXTEND, DECODE = 1, 2  # sglang ForwardMode (0.4 ... 0.5.23)
WEIGHTS = {"native"}  # the shapes whose engine also runs the weight syncs (DP=1)
PLANT = sglang_live.WeightPlant()


# the default tier's one live SGLang engine is the newest shape (tests/support/cached_venvs.py
# builds only its venv there); the patch shape's engine runs in the full tier
@pytest.fixture(scope="module", params=[pytest.param("patch", marks=pytest.mark.full), "native"])
def run(request, tmp_path_factory):
    shape = request.param
    python = sglang_live.python_or_skip(shape)
    model = vllm_cpu.tiny_model(python=python)
    work = tmp_path_factory.mktemp(f"sglang-{shape}")
    script = work / "run_grpo_sglang.sh"
    dp = (f"actor_rollout_ref.rollout.data_parallel_size={DP[shape]}",) if DP[shape] > 1 else ()
    script.write_text(sglang_live.plain_script(model, *dp))
    steps = ",".join(map(str, STEPS))
    weights = ("--weights",) if shape in WEIGHTS else ()
    with sglang_live.session(python, script, work, "--steps", steps, *weights) as flow:
        server_args, plan = flow.server_args, None
        if weights:
            server_args, plan = {**server_args, **PLANT.write(work)}, PLANT.plan()
        engine = sglang_live.run_engine(python, model, flow.env, server_args, work, weights=plan)
        tree = sglang_live.sglang_tree(python)
        patched = sorted(str(p.relative_to(tree)) for p in tree.rglob("rl_msprobe_*.py"))
    return shape, flow, engine, patched


def test_prepare_asks_for_what_the_shape_needs(run):
    shape, flow, _, patched = run
    assert flow.detection["rollout"] == "sglang" and flow.detection["mode"] == "inference", flow.detection
    config = flow.prepared["configs"]["generate"]
    assert flow.server_args.get("disable_cuda_graph") is True, flow.argv  # enforce_eager=True
    assert flow.server_args.get("dp_size", 1) == DP[shape], flow.argv
    if shape == "patch":
        assert flow.sets == ["sglang-dump"], flow.prepared
        assert flow.env.get("MSPROBE_ROLLOUT_CONFIG") == config, flow.argv
        assert "msprobe_dump_config" not in flow.server_args, flow.argv  # a TypeError below 0.5.11
        assert patched == ["srt/model_executor/rl_msprobe_dump.py"], patched
    else:
        assert flow.sets == ["verl-weights", "sglang-weights"], flow.prepared  # --weights only
        assert flow.sglang_sets == ["sglang-weights"], flow.prepared
        assert flow.server_args.get("msprobe_dump_config") == config, flow.argv
        assert "MSPROBE_ROLLOUT_CONFIG" not in flow.env, flow.argv
        assert patched == ["srt/rl_msprobe_weights.py"], patched


def test_the_engine_runs_and_dumps_one_rank_per_dp_replica(run):
    shape, flow, engine, _ = run
    assert engine.returncode == 0 and engine.result, engine.tail()
    assert len(engine.result["texts"]) == len(sglang_live.PROMPTS), engine.result
    # the main process never imports msprobe: the dumps come from the scheduler subprocesses
    assert engine.result["main_imported_msprobe"] is False, engine.result
    dumps = sorted(flow.dump_root.rglob("dump.json"))
    layout = sorted(str(p.parent.relative_to(flow.dump_root)) for p in dumps)
    assert layout == sorted(f"step{s}/rank{r}" for s in STEPS for r in range(DP[shape])), (
        layout,
        engine.tail(),
    )
    for dump in dumps:
        assert {p.name for p in dump.parent.iterdir()} >= {"dump.json", "construct.json", "stack.json"}
    stacks = (flow.dump_root / "step0" / "rank0" / "stack.json").read_text()
    assert "model_runner.py" in stacks, stacks[:2000]  # ModelRunner.forward is on every stack


def _forward(dump: Path) -> dict:
    """What one dumped forward pass ran: the model's input_ids / positions and the ForwardBatch."""
    data = json.loads(dump.read_text())["data"]
    (name,) = [n for n in data if n.startswith("Module.model.") and ".Qwen2Model.forward." in n]
    ids, positions, batch = data[name]["input_args"][:3]
    return {
        "mode": batch["forward_mode"]["value"],
        "requests": batch["batch_size"]["value"],
        "tokens": ids["shape"][0],
        "first_position": positions["Min"],
        "layers": sorted({n.split("layers.")[1].split(".")[0] for n in data if "layers." in n}),
    }


def test_prefills_embed_the_prompts_and_decodes_one_token_per_request(run):
    """Per rank: step0 is a prefill from position 0, every decode embeds one token per request;
    over all ranks the prefills embed exactly the prompts' tokens."""
    shape, flow, engine, _ = run
    prefilled = 0
    for rank in range(DP[shape]):
        passes = [_forward(flow.dump_root / f"step{s}" / f"rank{rank}" / "dump.json") for s in STEPS]
        assert passes[0]["mode"] == EXTEND and passes[0]["first_position"] == 0, (rank, passes)
        decodes = [p for p in passes if p["mode"] == DECODE]
        assert decodes and all(p["tokens"] == p["requests"] for p in decodes), (rank, passes)
        assert all(p["layers"] == ["0", "1"] for p in passes), (rank, passes)
        prefilled += sum(p["tokens"] for p in passes if p["mode"] == EXTEND)
    assert prefilled == sum(engine.result["prompt_tokens"]), (prefilled, engine.result)


def test_dumps_check_reads_them_as_inference(run):
    _, flow, _, _ = run
    code, report, proc = live_flow.cli_json("dumps", "check", str(flow.dump_root))
    assert code == 0 and report["ok"], live_flow.describe(proc)
    assert report["mode"] == "inference", report


def test_weight_syncs_are_equal_then_name_each_planted_tensor(run):
    """Sync 1 EQUAL with every model tensor accounted for; sync 2 exactly PLANT.resident, stage
    resident (received equal); sync 3 exactly PLANT.transfer, stage received (resident equal to
    what was received); the first difference is sync 2's."""
    shape, flow, engine, _ = run
    if shape not in WEIGHTS:  # DP=2: no weight sync ran, and prepare was not asked for one
        assert engine.result.get("weight_syncs") is None and "RL_MSPROBE_WEIGHTS_DIR" not in flow.env
        return
    assert engine.returncode == 0 and engine.result.get("weight_syncs"), engine.tail()
    sent = {s["tensors"] for s in engine.result["weight_syncs"]}
    assert len(engine.result["weight_syncs"]) == 3 and len(sent) == 1, engine.result
    assert all(s["buckets"] == PLANT.buckets for s in engine.result["weight_syncs"]), engine.result
    folder = Path(flow.env["RL_MSPROBE_WEIGHTS_DIR"])
    code, doc, proc = live_flow.cli_json("weights", "compare", str(folder))
    assert code == 1 and doc["verdict"] == "DIFFERENT", live_flow.describe(proc)
    steps = {s["sync"]: s for s in doc["steps"]}
    assert sorted(steps) == [1, 2, 3], doc["steps"]
    (count,) = sent
    first = steps[1]
    assert first["verdict"] == "EQUAL" and first["tp_size"] == 1, first
    assert first["sent_tensors"] == first["model_tensors"] == count, first
    differs = {
        sync: sorted((r["name"], stage) for r in doc["tensors"] if r["sync"] == sync
                     for stage in ("received", "resident") if r[stage]["status"] == "differs")
        for sync in steps
    }  # fmt: skip
    assert differs == {1: [], 2: [(PLANT.resident, "resident")], 3: [(PLANT.transfer, "received")]}, differs
    for sync in (2, 3):
        assert steps[sync]["sent_tensors"] == steps[sync]["model_tensors"] == count, steps[sync]
    held = [r for r in doc["tensors"] if r["sync"] == 1 and r["resident"]["status"] != "tied"]
    assert held and {r.get("how") for r in held} == {"parameter"}, held[:3]  # SGLang keeps its parameters
    # sync 1 is clean: every part held in the dtype and shape it was received in reuses the received
    # statistics (same bytes), no other part does (a dtype conversion: the engine's own dtype)
    lines = [json.loads(x) for p in folder.glob("re*-*.jsonl") for x in p.read_text().splitlines()]
    layout = {
        (x["stage"], x["name"]): (x["dtype"], x["shape"]) for x in lines if x["sync"] == 1 and "name" in x
    }
    alike = sum(layout.get(("received", n)) == v for (stage, n), v in layout.items() if stage == "resident")
    print(f"SGLang sync 1: {first['resident_reused']} resident fingerprints reused, {alike} held as received")
    assert first["resident_reused"] == alike, first
    fd = doc["first_difference"]
    assert (fd["sync"], fd["name"], fd["stage"]) == (2, PLANT.resident, "resident"), fd


def test_sglang_dump_is_refused_where_sglang_dumps_itself():
    """SGLang 0.5.23 declares msprobe_dump_config outside ServerArgs' body (arg_groups/fields/):
    the native support is read from ModelRunner, so the patch is never put on top of it."""
    python = sglang_live.python_or_skip("native")
    tree = sglang_live.sglang_tree(python)
    before = vllm_cpu.tree_digest(tree)
    code, status, proc = live_flow.cli_json("patch", "status", "sglang-dump", "--python", str(python))
    assert code == 0 and status["sets"][0]["status"] == "native", live_flow.describe(proc)
    proc = live_flow.cli("patch", "apply", "sglang-dump", "--python", str(python))
    assert proc.returncode == 2 and "msprobe_dump_config=" in proc.stderr, live_flow.describe(proc)
    assert vllm_cpu.tree_digest(tree) == before

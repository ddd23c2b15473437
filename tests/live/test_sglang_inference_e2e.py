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
- SGLang 0.5.23 (``native``): prepare prints no patch set; the derived command passes
  `engine_kwargs.sglang.msprobe_dump_config`, which SGLang itself reads; `sglang-dump` is refused.

One engine per shape (module-scoped), its dumps reused by every check. Measured here (2 cores
shared with four other sessions, load 10-18, 2026-12-01): the whole module 426 s warm (`-m e2e`,
9 passed): the patch shape (DP=2) 217-224 s (CLI steps, engine start, 4 dumped forwards per
replica, revert), the native shape 165-227 s, the refusal check 7-9 s; cold, add the venv builds
(tests/support/sglang_venv.py: 204 s and 801 s under that load).
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


@pytest.fixture(scope="module", params=["patch", "native"])
def run(request, tmp_path_factory):
    shape = request.param
    python = sglang_live.python_or_skip(shape)
    model = vllm_cpu.tiny_model(python=python)
    work = tmp_path_factory.mktemp(f"sglang-{shape}")
    script = work / "run_grpo_sglang.sh"
    dp = (f"actor_rollout_ref.rollout.data_parallel_size={DP[shape]}",) if DP[shape] > 1 else ()
    script.write_text(sglang_live.plain_script(model, *dp))
    steps = ",".join(map(str, STEPS))
    with sglang_live.session(python, script, work, "--steps", steps) as flow:
        engine = sglang_live.run_engine(python, model, flow.env, flow.server_args, work)
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
        assert flow.sets == [], flow.prepared
        assert flow.server_args.get("msprobe_dump_config") == config, flow.argv
        assert "MSPROBE_ROLLOUT_CONFIG" not in flow.env, flow.argv
        assert patched == [], patched


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

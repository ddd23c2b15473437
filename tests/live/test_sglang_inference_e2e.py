"""Inference mode on a live SGLang CPU engine, both code shapes, from a plain launch script through
the CLI: `detect`, `prepare --mode inference --backend sglang --python PY`, `patch apply` of what
prepare printed, the engine the derived command implies (tests/support/sglang_live.py), `dumps
check` on what it wrote, `patch revert` and a byte-identical sglang tree.

- SGLang 0.5.10.post1 (``patch``): prepare prints `sglang-dump`; the derived command gives the
  rollout MSPROBE_ROLLOUT_CONFIG; the dumps come from the patched ModelRunner in the spawned
  scheduler process (the engine's main process never imports msprobe).
- SGLang 0.5.23 (``native``): prepare prints no patch set; the derived command passes
  `engine_kwargs.sglang.msprobe_dump_config`, which SGLang itself reads.

One engine per shape (module-scoped), its dumps reused by every check. Measured here (2 cores
shared with four other sessions, load 3-11, 2026-12-01): the patch shape 145-276 s (CLI steps,
engine start, 5 forwards, revert), the native shape 165 s, the refusal check 7 s; with the venvs
cold add their builds (tests/support/sglang_venv.py: 204 s and 801 s under that load).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import live_flow, sglang_live, vllm_cpu

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
STEPS = (0, 1, 2, 3)  # the prefills (one per prompt, or both at once), then decode steps


@pytest.fixture(scope="module", params=["patch", "native"])
def run(request, tmp_path_factory):
    shape = request.param
    python = sglang_live.python_or_skip(shape)
    model = vllm_cpu.tiny_model(python=python)
    work = tmp_path_factory.mktemp(f"sglang-{shape}")
    script = work / "run_grpo_sglang.sh"
    script.write_text(sglang_live.plain_script(model))
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


def test_the_engine_runs_and_dumps_where_the_shape_says(run):
    shape, flow, engine, _ = run
    assert engine.returncode == 0 and engine.result, engine.tail()
    assert len(engine.result["texts"]) == len(sglang_live.PROMPTS), engine.result
    # the main process never imports msprobe: the dumps come from the scheduler subprocess
    assert engine.result["main_imported_msprobe"] is False, engine.result
    dumps = sorted(flow.dump_root.rglob("dump.json"))
    layout = sorted(str(p.parent.relative_to(flow.dump_root)) for p in dumps)
    assert layout == [f"step{s}/rank0" for s in STEPS], (layout, engine.tail())
    for dump in dumps:
        assert {p.name for p in dump.parent.iterdir()} >= {"dump.json", "construct.json", "stack.json"}
    stacks = (flow.dump_root / "step0" / "rank0" / "stack.json").read_text()
    assert "model_runner.py" in stacks, stacks[:2000]  # ModelRunner.forward is on every stack


def _embed_tokens(dump: Path) -> int:
    """How many tokens the forward pass of DUMP embedded (the embedding's input length)."""
    data = json.loads(dump.read_text())["data"]
    (name,) = [n for n in data if "embed_tokens" in n and n.endswith(".forward.0")]
    (ids,) = [a for a in data[name]["input_args"] if a.get("type") == "torch.Tensor"][:1]
    return ids["shape"][0]


def test_prefills_embed_the_prompts_and_decodes_one_token_per_request(run):
    """Prefill forwards embed exactly the prompts' tokens; every decode forward one per request."""
    _, flow, engine, _ = run
    tokens = [_embed_tokens(flow.dump_root / f"step{s}" / "rank0" / "dump.json") for s in STEPS]
    prompts = engine.result["prompt_tokens"]
    running = len(sglang_live.PROMPTS)  # a decode forward embeds one token per running request
    prefills = [n for n in tokens if n > running]
    assert tokens[0] > running and sum(prefills) == sum(prompts), (tokens, prompts)
    assert running in tokens, (tokens, prompts)  # a decode forward of both requests
    data = json.loads((flow.dump_root / "step0" / "rank0" / "dump.json").read_text())["data"]
    assert any("layers.1." in name for name in data), list(data)[:10]


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

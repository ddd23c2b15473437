"""End to end with the real vLLM CPU engine on the rollout side.

Rollout: vLLM's CPU build (cached test venv, tests/support/vllm_cpu.py) with its model runner
patched by rl-msprobe's `vllm-dump` set, a tiny local Qwen2, one `generate` call per prompt so
that each prompt is prefilled alone; tensor L0 dumps plus the dispatch log. Training: the same
saved weights in transformers' Qwen2ForCausalLM (named as FSDP1 wraps it) through rl-msprobe's
training helper, one micro-batch per request id taken from vLLM's outputs (standin.py `train
--model --prompts`; verl's own engine is not run here). Then `correlate` and msprobe's
`compare --consistent_check`: identical weights are consistent; noise on layer 1's
mlp.down_proj on the training side is the first divergence.

The FSDP2 variant does it on what `prepare` writes by default (statistics, level mix) with the
real FSDP2 `fully_shard` on the training side, both sides and msprobe itself in the shared job
venv (`dumps compare --python`). Measured 2026-11-30: CONSISTENT with 60 matched rows per pair
(85% of the rollout's modules), and DIVERGENT first at layer 1's mlp when perturbed; the two
FSDP2 tests took 10 min wall on this 2-core machine under a load average of ~25.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from tests.support import vllm_cpu

# the full tier: the default tier's live consistency job compares a real vLLM rollout with FSDP2
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400), pytest.mark.full]
STANDIN = Path(__file__).resolve().parents[1] / "dumps" / "standin.py"
PROMPTS = ["the model rollout", "prefill decode tensor layer"]

GENERATE = """
import json, os
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0, dtype="float32")
res = {"pid": os.getpid(), "outputs": []}
for prompt in PROMPTS:  # one call per prompt: each prefill step holds one request
    o = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    res["outputs"].append({"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids)})
print("RESULT " + json.dumps(res))
"""


def _config(dump_path: Path, task: str, level: str) -> dict:
    section = {"scope": [], "list": [], "data_mode": ["forward"]}
    if task == "statistics":
        section["summary_mode"] = "statistics"
    return {"task": task, "dump_path": str(dump_path), "rank": [], "step": [], "level": level, task: section}


def _sides(
    base: Path, task: str, level: str, train_args: tuple[str, ...] = (), python: str = sys.executable
) -> dict:
    """vLLM (patched with vllm-dump) dumps one prefill per prompt into base/gen; the same weights
    on the training side in base/train and, with layer 1's down_proj perturbed, base/train_perturbed."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    venv_python = vllm_cpu.venv_python_or_skip()
    model = vllm_cpu.tiny_model(python=venv_python)
    config = base / "rollout_config.json"
    config.write_text(json.dumps(_config(base / "gen", task, level)))
    head = f"MODEL = {str(model)!r}\nPROMPTS = {PROMPTS!r}\n"
    with vllm_cpu.patched(venv_python, "vllm-dump"):
        proc = vllm_cpu.run_in_venv(
            venv_python,
            head + GENERATE,
            env=vllm_cpu.engine_env(MSPROBE_ROLLOUT_CONFIG=str(config)),
            cwd=base,
            timeout=1800,
        )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    outputs = json.loads(lines[-1][len("RESULT ") :])["outputs"]
    prompts = base / "prompts.json"
    prompts.write_text(json.dumps([[o["request_id"], o["prompt_token_ids"]] for o in outputs]))
    sides = {"train": [], "train_perturbed": ["--perturb", "1"]}
    env = {**os.environ, "STANDIN_TASK": task, "STANDIN_LEVEL": level}
    procs = {
        k: subprocess.Popen(
            [
                python,
                str(STANDIN),
                "train",
                str(base / k),
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                *a,
                *train_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=base,
            env=env,
        )
        for k, a in sides.items()
    }
    for k, p in procs.items():
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0, f"{k} failed:\n{out.decode(errors='replace')[-3000:]}"
    return {"base": base, "gen": base / "gen", "outputs": outputs, "python": venv_python}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tensor L0 dumps; training named as FSDP1 wraps the model, in this interpreter."""
    pytest.importorskip("transformers", reason="transformers is in the `test` extra")
    return _sides(tmp_path_factory.mktemp("vllm_e2e"), "tensor", "L0")


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What `prepare` writes by default (statistics, level mix) on both sides; training wrapped by
    the real FSDP2 `fully_shard` (single-process gloo group) in the shared job venv, its forward
    with grad enabled as in the actor's update."""
    python = str(vllm_cpu.venv_python_or_skip())
    return _sides(tmp_path_factory.mktemp("vllm_fsdp2"), "statistics", "mix", ("--fsdp2",), python)


def _compare(run: dict, train: str, *extra: str) -> tuple[int, dict]:
    res = CliRunner().invoke(
        main,
        [
            "dumps",
            "compare",
            str(run["gen"]),
            str(run["base"] / train),
            "--out",
            str(run["base"] / f"cmp_{train}"),
            "-j",
            "2",
            "--json",
            *extra,
        ],
    )
    assert res.stdout.strip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout)


def test_correlate_pairs_every_prompt(run: dict) -> None:
    res = CliRunner().invoke(
        main, ["dumps", "correlate", str(run["gen"]), str(run["base"] / "train"), "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert sorted(p["request_id"] for p in doc["pairs"]) == sorted(o["request_id"] for o in run["outputs"])
    assert doc["skipped_lines"]["rollout: decode step"] == len(PROMPTS)
    assert doc["unmatched"] == []


def test_identical_weights_are_consistent(run: dict) -> None:
    code, doc = _compare(run, "train")
    assert code == 0 and doc["consistent"], json.dumps(doc, indent=1)[:5000]
    for pair in doc["pairs"]:
        s = pair["summary"]
        assert s["counts"]["pass"] > 100  # msprobe matched fused vLLM modules to the training ones
        assert all(p["cosine"] > 0.9999 for p in s["layers"])


def test_perturbed_layer_is_the_first_divergence(run: dict) -> None:
    code, doc = _compare(run, "train_perturbed")
    assert code == 1 and not doc["consistent"]
    for pair in doc["pairs"]:
        first = pair["summary"]["first_divergence"]
        assert (first["module"], first["tensor"]) == ("model.layers.1.mlp.down_proj", "output.0"), first
        layer0 = next(p for p in pair["summary"]["layers"] if p["layer"] == "0")
        assert layer0["divergent"] == 0 and layer0["cosine"] > 0.9999


def test_fsdp2_default_dumps_identical_weights_consistent(fsdp2_run: dict) -> None:
    """msprobe runs in the job venv (--python); the FSDP2 names and the mix level are given to
    it as copies it can match; Required_Grad (the actor's tensors require grad) is a convention."""
    code, doc = _compare(fsdp2_run, "train", "--python", str(fsdp2_run["python"]))
    assert code == 0 and doc["verdict"].startswith("CONSISTENT"), json.dumps(doc, indent=1)[:6000]
    for pair in doc["pairs"]:
        s = pair["summary"]
        assert s["matched_rows"] > 50 and s["coverage"] >= 0.5, s
        assert any("FSDP1" in n for n in pair["inputs"]) and any("API row" in n for n in pair["inputs"])


def test_fsdp2_default_dumps_perturbed_layer_first(fsdp2_run: dict) -> None:
    code, doc = _compare(fsdp2_run, "train_perturbed", "--python", str(fsdp2_run["python"]))
    assert code == 1 and doc["verdict"].startswith("DIVERGENT"), doc["verdict"]
    for pair in doc["pairs"]:
        first = pair["summary"]["first_divergence"]
        assert first["layer"] == 1 and first["module"].startswith("model.layers.1.mlp"), first

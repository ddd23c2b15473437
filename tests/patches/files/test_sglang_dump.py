"""The files the SGLang sets add to a tree, on their own and through a patched ModelRunner.

`rl_msprobe_dump.py` (sglang-dump): which config a runner uses (PD roles), rank ids under data
parallelism, nothing at all while no variable is set; then a small tree shaped like SGLang's
is patched with `rl-msprobe patch apply sglang-dump` and its ModelRunner runs forward passes
under the real msprobe. `rl_msprobe_bootstrap_room.py` (sglang-bootstrap-room): the pinned
room through the patched `GenerateReqInput._normalize_bootstrap_params`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import types
from enum import Enum
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from rl_msprobe.codemods.sglang_io_struct import SGLangIoStruct
from tests.support.codemod_cases import FIXTURES
from tests.support.trees import init_repo, run_cli

FILES = Path(__file__).resolve().parents[3] / "rl_msprobe/patches/files/sglang/sglang/srt"
DUMP_FILE = FILES / "model_executor/rl_msprobe_dump.py"
ROOM_FILE = FILES / "managers/rl_msprobe_bootstrap_room.py"
ENVS = ("MSPROBE_ROLLOUT_CONFIG", "MSPROBE_PREFILL_CONFIG", "MSPROBE_DECODE_CONFIG", "MSPROBE_BOOTSTRAP_ROOM")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dump = _load(DUMP_FILE, "sglang_rl_msprobe_dump_under_test")
room = _load(ROOM_FILE, "sglang_rl_msprobe_bootstrap_room_under_test")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


class DisaggregationMode(Enum):  # some SGLang versions keep the mode as an enum
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


# ---------------------------------------------------------------- rl_msprobe_dump.py


@pytest.mark.parametrize(
    ("mode", "env", "expected"),
    [
        ("null", {"MSPROBE_ROLLOUT_CONFIG": "/r.json", "MSPROBE_PREFILL_CONFIG": "/p.json"}, "/r.json"),
        ("prefill", {"MSPROBE_ROLLOUT_CONFIG": "/r.json", "MSPROBE_PREFILL_CONFIG": "/p.json"}, "/p.json"),
        ("decode", {"MSPROBE_PREFILL_CONFIG": "/p.json", "MSPROBE_DECODE_CONFIG": "/d.json"}, "/d.json"),
        ("decode", {"MSPROBE_ROLLOUT_CONFIG": "/r.json", "MSPROBE_PREFILL_CONFIG": "/p.json"}, "/r.json"),
        ("prefill", {"MSPROBE_DECODE_CONFIG": "/d.json"}, None),
        (DisaggregationMode.PREFILL, {"MSPROBE_PREFILL_CONFIG": "/p.json"}, "/p.json"),
        (None, {"MSPROBE_ROLLOUT_CONFIG": "/r.json"}, "/r.json"),  # 0.4.x without the field
        ("null", {"MSPROBE_ROLLOUT_CONFIG": ""}, None),
    ],
)
def test_config_by_pd_role(monkeypatch, mode, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    server_args = NS() if mode is None else NS(disaggregation_mode=mode)
    assert dump.config_path(server_args) == expected


def test_rank_id_only_with_data_parallelism():
    assert dump.rank_id(NS(gpu_id=3, server_args=NS(dp_size=2))) == 3
    assert dump.rank_id(NS(gpu_id=3, server_args=NS(dp_size=1))) is None
    assert (
        dump.rank_id(NS(gpu_id=3, dp_size=1, server_args=NS(dp_size=4))) == 3
    )  # 0.5.10: dp_size 1 w/o dp-attention
    assert dump.rank_id(NS(gpu_id=0, server_args=NS())) is None


def test_unset_means_no_debugger_and_no_msprobe_import():
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        from types import SimpleNamespace as NS
        spec = importlib.util.spec_from_file_location("h", {str(DUMP_FILE)!r})
        h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
        runner = NS(server_args=NS(disaggregation_mode="null", disable_cuda_graph=False), gpu_id=0, model=None)
        assert h.create(runner) is None
        h.start(runner); h.finish(runner)
        assert runner.server_args.disable_cuda_graph is False
        assert not [m for m in sys.modules if m.startswith(("msprobe", "torch"))], "nothing heavy imported"
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_draft_worker_gets_no_debugger(monkeypatch, tmp_path):
    config = tmp_path / "c.json"
    config.write_text("{}")
    monkeypatch.setenv("MSPROBE_ROLLOUT_CONFIG", str(config))
    runner = NS(server_args=NS(), is_draft_worker=True)
    assert dump.create(runner) is None


def test_missing_config_file_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("MSPROBE_ROLLOUT_CONFIG", str(tmp_path / "nope.json"))
    with pytest.raises(dump.RlMsprobeDumpError, match="nope.json"):
        dump.create(NS(server_args=NS(), is_draft_worker=False))


# ---------------------------------------------------------------- a patched ModelRunner, real msprobe

MODEL_RUNNER = '''\
"""A tiny tree shaped like SGLang's ModelRunner (written for rl-msprobe tests)."""
import torch


class ModelRunner:
    def __init__(self, server_args, gpu_id, is_draft_worker=False):
        # Parse args
        self.mem_fraction_static = 0.5
        self.gpu_id = gpu_id
        self.server_args = server_args
        self.is_draft_worker = is_draft_worker
        self.forward_pass_id = 0
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    def forward(self, forward_batch):
        self.forward_pass_id += 1

        with torch.no_grad():
            output = self.model(forward_batch)

        return output
'''

RUN = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace as NS
    import torch
    sys.path.insert(0, sys.argv[1])
    from sglang.srt.model_executor.model_runner import ModelRunner
    server_args = NS(disaggregation_mode=sys.argv[2], dp_size=int(sys.argv[3]), disable_cuda_graph=False)
    runner = ModelRunner(server_args, gpu_id=int(sys.argv[4]))
    for _ in range(3):
        runner.forward(torch.randn(2, 4))
    print(json.dumps({"cuda_graph_off": server_args.disable_cuda_graph}))
    """
)


def _config(path: Path, dump_path: Path) -> Path:
    path.write_text(
        json.dumps({"task": "statistics", "dump_path": str(dump_path), "level": "L0", "step": [0, 1]})
    )
    return path


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-mini")
    package = root / "sglang" / "srt" / "model_executor"
    package.mkdir(parents=True)
    for folder in (root / "sglang", root / "sglang" / "srt", package):
        (folder / "__init__.py").write_text("")
    (package / "model_runner.py").write_text(MODEL_RUNNER)
    init_repo(root)
    code, out, err = run_cli("patch", "apply", "sglang-dump", "--tree", str(root), "--json")
    assert code == 0, err
    assert set(json.loads(out)["changed"]) == {
        "sglang/srt/model_executor/model_runner.py",
        "sglang/srt/model_executor/rl_msprobe_dump.py",
    }
    return root


def _run(tree: Path, env: dict[str, str], mode="null", dp_size=1, gpu_id=0) -> dict:
    pytest.importorskip("msprobe", reason="msprobe (mindstudio-probe) is in the [msprobe] extra")
    import os

    full_env = {k: v for k, v in os.environ.items() if k not in ENVS} | env
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(tree), mode, str(dp_size), str(gpu_id)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_patched_runner_dumps_one_step_per_forward(patched_tree, tmp_path):
    config = _config(tmp_path / "rollout.json", tmp_path / "dump")
    result = _run(patched_tree, {"MSPROBE_ROLLOUT_CONFIG": str(config)})
    assert result["cuda_graph_off"] is True
    steps = sorted(p.name for p in (tmp_path / "dump").glob("step*"))
    assert steps == ["step0", "step1"]  # three forwards, config step [0, 1]
    (dump_json,) = (tmp_path / "dump" / "step0").glob("*/dump.json")
    data = json.loads(dump_json.read_text())["data"]
    assert any(key.startswith("Module.") for key in data), list(data)[:5]


def test_data_parallel_rank_names_the_folder(patched_tree, tmp_path):
    config = _config(tmp_path / "rollout.json", tmp_path / "dump")
    _run(patched_tree, {"MSPROBE_ROLLOUT_CONFIG": str(config)}, dp_size=2, gpu_id=1)
    assert [p.name for p in (tmp_path / "dump" / "step0").iterdir()] == ["rank1"]


def test_pd_roles_dump_to_their_own_configs(patched_tree, tmp_path):
    env = {
        "MSPROBE_PREFILL_CONFIG": str(_config(tmp_path / "prefill.json", tmp_path / "prefill")),
        "MSPROBE_DECODE_CONFIG": str(_config(tmp_path / "decode.json", tmp_path / "decode")),
    }
    _run(patched_tree, env, mode="prefill")
    assert (tmp_path / "prefill" / "step0").is_dir() and not (tmp_path / "decode").exists()
    _run(patched_tree, env, mode="decode")
    assert (tmp_path / "decode" / "step0").is_dir()


def test_patched_runner_without_a_config_dumps_nothing(patched_tree, tmp_path):
    result = _run(patched_tree, {})
    assert result["cuda_graph_off"] is False
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- rl_msprobe_bootstrap_room.py


@pytest.fixture
def generate_req_input(monkeypatch):
    """GenerateReqInput from the patched io_struct fixture, importing the real helper file."""
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.rl_msprobe_bootstrap_room", room)
    sys.modules["sglang.srt.managers"].rl_msprobe_bootstrap_room = room
    source = SGLangIoStruct().apply(
        (FIXTURES / SGLangIoStruct().fixture_folder / "normalize_v052.before.py").read_text()
    )
    module = types.ModuleType("io_struct_under_test")
    monkeypatch.setitem(sys.modules, "io_struct_under_test", module)
    exec(compile(source, "io_struct.py", "exec"), module.__dict__)
    return module.GenerateReqInput


def _rooms(cls, given, num=3):
    request = cls(bootstrap_room=given)
    request._normalize_bootstrap_params(num)
    return request.bootstrap_room


def test_pinned_room_for_batches_without_one(monkeypatch, generate_req_input):
    assert _rooms(generate_req_input, None) == [None, None, None]
    monkeypatch.setenv("MSPROBE_BOOTSTRAP_ROOM", "1000")
    assert _rooms(generate_req_input, None) == [1000, 1001, 1002]  # DP rank = room % dp_size, every run
    assert _rooms(generate_req_input, 7) == [7, 8, 9]  # a room the caller set is kept


@pytest.mark.parametrize("value", ["-1", "room"])
def test_bad_room_is_refused(monkeypatch, value):
    monkeypatch.setenv("MSPROBE_BOOTSTRAP_ROOM", value)
    with pytest.raises(ValueError, match="MSPROBE_BOOTSTRAP_ROOM"):
        room.pin(NS(bootstrap_room=None))

"""What the verl-consistency patches DO, not just where they go.

Part 1 (any machine, main interpreter): the helper file the sets add
(`verl/utils/rl_msprobe_consistency.py`) on plain torch tensors, jagged nested tensors and a
stand-in rollout server.

Part 2 (e2e, the cached verl CPU test venv of tests/support/verl_venv.py): verl releases patched
by `rl-msprobe patch apply`, imported first on PYTHONPATH in a fresh process
(tests/patches/files/consistency_scenario.py): trimming on verl's own DataProto, the prompts-only
copy through the REAL TransferQueue (in-process Ray), the patched rollout clients against a
stand-in server (a Ray rollout server cannot run here), and the whole chain from the id the
server received to the engine's update_actor_log.jsonl.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support import verl_venv
from tests.support.trees import patched_release

HELPER = (
    Path(__file__).resolve().parents[3]
    / "rl_msprobe"
    / "patches"
    / "files"
    / "verl"
    / "verl"
    / "utils"
    / "rl_msprobe_consistency.py"
)
RECORDS_HELPER = Path(__file__).resolve().parents[3] / "rl_msprobe/patches/files/common/rl_msprobe_records.py"
SCENARIO = Path(__file__).resolve().with_name("consistency_scenario.py")
ENGINE_SCENARIO = Path(__file__).resolve().parents[2] / "support" / "verl_engine_scenario.py"
FLAGS = ("PROMPTS_ONLY", "DUMP_ON", "RL_MSPROBE_REQUEST_ID", "DUMP_PHASE")


@pytest.fixture
def helper(monkeypatch):
    for flag in FLAGS:
        monkeypatch.delenv(flag, raising=False)
    spec = importlib.util.spec_from_file_location("rl_msprobe_consistency_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def padded(mrope: bool = False, logprobs: bool = True) -> dict:
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    responses = torch.tensor([[11, 12, 0], [13, 14, 15]])
    attention = torch.cat(
        [torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), torch.tensor([[1, 1, 0], [1, 1, 1]])], 1
    )
    position = (attention.cumsum(1) - 1).clamp(min=0)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.stack([position, position + 10, position + 20], 1) if mrope else position,
        "response_mask": attention[:, 4:],
    }
    if logprobs:
        batch["rollout_log_probs"] = torch.full((2, 3), -0.5)
    return batch


# ---------------------------------------------------------------- part 1: the helper itself


def test_helper_is_standalone():
    text = HELPER.read_text()
    assert "Added to this tree by rl-msprobe" in text[:300]
    assert "rl_msprobe." not in text.replace("rl_msprobe_consistency", "")  # never imports rl-msprobe
    assert "import msprobe" not in text


def test_without_prompts_only_nothing_changes(helper):
    batch = padded()
    before = {k: v.clone() for k, v in batch.items()}
    assert helper.trim_to_prompts(batch) is batch
    assert all(torch.equal(batch[k], before[k]) for k in before)


@pytest.mark.parametrize("mrope", [False, True], ids=["2d-position-ids", "3d-position-ids"])
def test_trim_cuts_the_responses(helper, monkeypatch, mrope):
    monkeypatch.setenv("PROMPTS_ONLY", "1")
    batch = padded(mrope=mrope)
    position_before = batch["position_ids"].clone()
    helper.trim_to_prompts(batch)
    assert torch.equal(batch["input_ids"], batch["prompts"])
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert torch.equal(batch["position_ids"], position_before[..., :4])
    assert batch["position_ids"].dim() == (3 if mrope else 2)
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert tuple(batch[key].shape) == (2, 0), key
    assert torch.equal(batch["prompts"], torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]))


def test_trim_absent_optional_keys_and_twice(helper, monkeypatch):
    monkeypatch.setenv("PROMPTS_ONLY", "1")
    batch = padded(logprobs=False)
    del batch["response_mask"]
    helper.trim_to_prompts(batch)
    assert "rollout_log_probs" not in batch and "response_mask" not in batch
    snapshot = {k: v.clone() for k, v in batch.items()}
    helper.trim_to_prompts(batch)  # nothing left to cut
    assert all(torch.equal(batch[k], snapshot[k]) for k in snapshot)
    assert helper.trim_to_prompts({"input_ids": torch.ones(2, 3)})["input_ids"].shape == (
        2,
        3,
    )  # no responses


def test_trim_ragged_jagged_rows(helper):
    """The v1 trainer keeps one unpadded row per sample (jagged nested tensors in TransferQueue)."""
    nested = lambda rows: torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)  # noqa: E731
    fields = {
        "prompts": nested([[5, 6], [7, 8, 9]]),
        "responses": nested([[11, 12, 13], [14]]),
        "input_ids": nested([[5, 6, 11, 12, 13], [7, 8, 9, 14]]),
        "position_ids": nested([[0, 1, 2, 3, 4], [0, 1, 2, 3]]),
        "response_mask": nested([[1, 1, 1], [1]]),
    }
    helper.trim_ragged(fields)
    assert [r.tolist() for r in fields["input_ids"].unbind()] == [[5, 6], [7, 8, 9]]
    assert [r.tolist() for r in fields["position_ids"].unbind()] == [[0, 1], [0, 1, 2]]
    assert [r.numel() for r in fields["responses"].unbind()] == [0, 0]


def test_prompts_forward_runs_a_trimmed_copy_and_returns_the_batch(helper, monkeypatch):
    """A DataProto trainer: its own recompute runs on a trimmed deep copy; the batch stays whole."""
    batch = SimpleNamespace(batch=padded(), meta_info={})
    seen = []

    class Trainer:
        def _compute_old_log_prob(self, data):
            seen.append({k: v.clone() for k, v in data.batch.items()})

    assert helper.prompts_forward(Trainer(), batch) is batch and seen == []  # no PROMPTS_ONLY: nothing
    monkeypatch.setenv("PROMPTS_ONLY", "1")
    assert helper.prompts_forward(Trainer(), batch) is batch
    assert len(seen) == 1 and torch.equal(seen[0]["input_ids"], batch.batch["prompts"])
    assert seen[0]["responses"].shape == (2, 0)
    assert batch.batch["input_ids"].shape == (2, 7) and batch.batch["responses"].shape == (2, 3)
    helper.prompts_forward(Trainer(), batch)  # a second patched line on the same batch (fully-async)
    assert len(seen) == 1


def test_engine_hook_dumps_only_the_prompts_only_copy(monkeypatch):
    """PROMPTS_ONLY=1: a micro-batch with response tokens (the step's own forward) is not dumped."""
    spec = importlib.util.spec_from_file_location("hooks_under_test", HELPER.with_name("rl_msprobe_hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    nested = lambda rows: torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)  # noqa: E731
    full = {"input_ids": torch.ones(1, 5), "responses": torch.ones(1, 2)}
    copy = {"input_ids": torch.ones(1, 3), "responses": torch.ones(1, 0)}
    jagged_full = {"response_mask": nested([[1, 1]])}
    jagged_copy = {"response_mask": nested([[]])}
    monkeypatch.delenv("PROMPTS_ONLY", raising=False)
    assert all(hooks.wants_batch(b) for b in (full, copy, jagged_full, jagged_copy))
    monkeypatch.setenv("PROMPTS_ONLY", "1")
    assert [hooks.wants_batch(b) for b in (full, copy, jagged_full, jagged_copy)] == [
        False,
        True,
        False,
        True,
    ]
    assert hooks.wants_batch({"input_ids": torch.ones(1, 3)})  # neither field: dumped as before


class StandInServer:
    """A rollout server's Ray actor handle: `generate.remote(...)` is awaitable."""

    def __init__(self):
        self.received = []
        outer = self

        class _Generate:
            def remote(self, request_id, **kwargs):
                outer.received.append(request_id)
                return outer._reply()

        self.generate = _Generate()

    async def _reply(self):
        return SimpleNamespace(token_ids=[1, 2], extra_fields={})


def _client(helper, server, prompt_ids=(1,)):
    """The patched client lines around the server call, as they stand in verl."""

    async def generate():
        server_ = helper.record_request_id(server)
        output = await server_.generate.remote(request_id="0f" * 16, prompt_ids=list(prompt_ids))
        helper.keep_request_id(output, server_)
        return output

    return asyncio.run(generate())


def test_request_id_is_what_the_server_received(helper, monkeypatch):
    monkeypatch.setenv("DUMP_ON", "1")
    monkeypatch.setattr(helper, "_SENT", {})
    server = StandInServer()
    output = _client(helper, server)
    assert server.received[0].startswith("rlm") and server.received[0] != "0f" * 16
    assert output.extra_fields["request_id"] == server.received[0]


def test_request_ids_are_stable_across_runs_and_unique_within_one(helper, monkeypatch):
    """A rerun (a fresh process: no prompt sent yet) sends the same ids for the same prompts in the
    same order; rollout.n copies of one prompt get distinct ids; the records' and the join's base id
    is the id itself (nothing that looks like vLLM's suffix to strip)."""
    monkeypatch.setenv("RL_MSPROBE_REQUEST_ID", "1")
    prompts = [(5, 6, 7), (5, 6, 7), (8, 9), (5, 6, 7)]

    def run():
        monkeypatch.setattr(helper, "_SENT", {})
        server = StandInServer()
        for prompt in prompts:
            _client(helper, server, prompt)
        return server.received

    first, second = run(), run()
    assert first == second and len(set(first)) == len(prompts)
    assert [rid.rsplit("n", 1)[1] for rid in first] == ["0", "1", "0", "2"]
    assert first[0].rsplit("n", 1)[0] == first[1].rsplit("n", 1)[0] != first[2].rsplit("n", 1)[0]
    spec = importlib.util.spec_from_file_location("records_for_ids", RECORDS_HELPER)
    records = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(records)
    assert [records.base_id(rid) for rid in first] == first
    assert [records.base_id(f"{rid}-0a1b2c3d") for rid in first] == first  # vLLM's own suffix dropped


def test_a_prompt_that_is_not_token_ids_keeps_the_callers_id(helper, monkeypatch):
    monkeypatch.setenv("DUMP_ON", "1")
    server = StandInServer()
    _client(helper, server, prompt_ids=("not", "ids"))
    assert server.received == ["0f" * 16]


def test_request_id_is_inert_without_the_flags(helper):
    server = StandInServer()
    assert helper.record_request_id(server) is server
    output = _client(helper, server)
    assert output.extra_fields == {} and server.received == ["0f" * 16]


def test_agent_loop_output_gets_the_first_id_of_its_task(helper, monkeypatch):
    """verl <= 0.7.0: the server's TokenOutput has no extra_fields; the id travels in the task."""
    monkeypatch.setenv("PROMPTS_ONLY", "1")

    class NoExtra:
        def __init__(self):
            self.token_ids = [1]

    async def sample(name):
        helper.begin_request()
        for turn in range(2):  # two turns, two ids: the prompt's prefill is the first
            server = helper.record_request_id(SimpleNamespace(generate=SimpleNamespace(remote=_echo)))
            output = await server.generate.remote(request_id=f"{name}-turn{turn}")
            helper.keep_request_id(output, server)
        return helper.attach_request_id(SimpleNamespace(extra_fields={}))

    async def _echo_impl():
        return NoExtra()

    def _echo(request_id, **kwargs):
        return _echo_impl()

    async def run():
        return await asyncio.gather(asyncio.create_task(sample("a")), asyncio.create_task(sample("b")))

    first, second = asyncio.run(run())
    assert first.extra_fields == {"request_id": "a-turn0"} and second.extra_fields == {
        "request_id": "b-turn0"
    }


def test_lift_request_id_for_the_v1_transfer_queue(helper, monkeypatch):
    field = {"extra_fields": {"request_id": "r1", "global_steps": 3}, "uid": "u"}
    assert "request_id" not in helper.lift_request_id(dict(field))  # inert without the flags
    monkeypatch.setenv("DUMP_ON", "1")
    assert helper.lift_request_id(dict(field))["request_id"] == "r1"
    assert helper.lift_request_id({"extra_fields": {}})["request_id"] == ""  # same keys for every sample


def test_request_ids_of_a_micro_batch():
    """The engine hook's reader (verl/utils/rl_msprobe_hooks.py) finds ids at top level or in extra_fields."""
    import numpy as np

    spec = importlib.util.spec_from_file_location(
        "rl_msprobe_hooks_under_test", HELPER.with_name("rl_msprobe_hooks.py")
    )
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    assert helper.request_ids({"request_id": np.array(["a", "b"], dtype=object)}) == ["a", "b"]
    assert helper.request_ids({"extra_fields": [{"request_id": "x"}, {"request_id": "y"}]}) == ["x", "y"]
    proto = SimpleNamespace(non_tensor_batch={"request_id": np.array(["p"], dtype=object)})
    assert helper.request_ids(proto) == ["p"]
    assert helper.request_ids({"input_ids": torch.ones(1, 2)}) == []


# ---------------------------------------------------------------- part 2: real verl in the venv


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return verl_venv.venv_python_or_skip()


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    trees: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in trees:
            dest = tmp_path_factory.mktemp("cons") / f"verl-{version}"
            trees[version] = patched_release("verl", version, dest, ["verl-consistency"], with_git=False)
        return trees[version]

    return get


def run_scenario(
    python: Path, tree: Path, cases: str, workdir: Path, **env: str
) -> subprocess.CompletedProcess:
    """One fresh process of the venv's python with the patched tree first on PYTHONPATH."""
    workdir.mkdir(parents=True, exist_ok=True)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DUMP_", "MSPROBE_", "PROMPTS_ONLY", "RL_MSPROBE_")) and k not in ("PYTHONPATH",)
    }
    base.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", **env)
    command = [str(python), str(SCENARIO), cases, str(workdir)]
    return subprocess.run(command, env=base, capture_output=True, text=True, timeout=600)


def scenario(python: Path, tree: Path, cases: str, workdir: Path, **env: str) -> dict:
    proc = run_scenario(python, tree, cases, workdir, **env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, (
        f"scenario {cases} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(lines[-1][len("RESULT:") :])
    assert result["verl_file"].startswith(str(tree)), "the patched copy must be the verl that runs"
    return result


@pytest.fixture(scope="module")
def newest(venv_python, patched, tmp_path_factory) -> dict:
    """verl 0.9.1, patched: the real TransferQueue (first, before any case stubs a module or sets a
    switch), trimming, the rollout client and the whole chain, in one process (one verl import)."""
    workdir = tmp_path_factory.mktemp("newest")
    dump = workdir / "dump"
    config = workdir / "config_actor.json"
    config.write_text(json.dumps({"task": "statistics", "level": "mix", "dump_path": str(dump)}))
    return scenario(
        venv_python,
        patched("0.9.1"),
        "tq,trim,llm_server,chain",
        workdir,
        MSPROBE_ACTOR_CONFIG=str(config),
        RL_MSPROBE_DUMP=str(dump),
        RL_MSPROBE_ENGINE_SCENARIO=str(ENGINE_SCENARIO),
    )


@pytest.mark.e2e
def test_trim_on_verls_own_dataproto(newest):
    result = newest["trim"]
    assert result["without_flag"] == {"same_object": True, "unchanged": True}
    for name, mrope, logprobs in (("2d", False, True), ("3d_no_logprobs", True, False)):
        case = result[name]
        before, after = case["before"], case["after"]
        assert after["input_ids"]["value"] == before["prompts"]["value"]
        assert after["attention_mask"]["value"] == [row[:4] for row in before["attention_mask"]["value"]]
        if mrope:
            assert after["position_ids"]["shape"] == [2, 3, 4]
            assert after["position_ids"]["value"] == [
                [r[:4] for r in s] for s in before["position_ids"]["value"]
            ]
        else:
            assert after["position_ids"]["value"] == [row[:4] for row in before["position_ids"]["value"]]
        assert after["responses"]["shape"] == [2, 0] and after["response_mask"]["shape"] == [2, 0]
        assert ("rollout_log_probs" in after) == logprobs
        if logprobs:
            assert after["rollout_log_probs"]["shape"] == [2, 0]
        assert after["non_tensor"] == before["non_tensor"] and after["len"] == 2
        assert case["idempotent"] and case["same_object"] and case["meta_info"] == {"temperature": 1.0}
        # verl's own next steps accept it: DataProto -> TensorDict -> no padding = the prompts only
        assert case.get("no_padding", {}).get("input_ids") == [[5, 6], [7, 8, 9, 10]], case.get(
            "no_padding_error"
        )
        assert case["no_padding"]["request_id"] == ["rid-a", "rid-b"]
        assert case["old_log_probs_shape"] == [2, 0]  # the trainer's way back: zero response columns


@pytest.mark.e2e
@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_llm_server_client_keeps_the_id_the_server_received(request, patched, tmp_path, version):
    if version == "0.9.1":
        result = request.getfixturevalue("newest")["llm_server"]
    else:
        python = request.getfixturevalue("venv_python")
        result = scenario(python, patched(version), "llm_server", tmp_path)["llm_server"]
    client = result["client"]
    assert len(client["received"]) == 1 and client["extra_fields"]["request_id"] == client["received"][0]
    assert client["extra_fields"]["global_steps"] == 7  # the server's own fields stay
    fully_async = result["fully_async"]
    assert len(fully_async["received"]) == 2  # aborted once, resumed
    assert fully_async["extra_fields"]["request_id"] == fully_async["received"][0]
    assert fully_async["token_ids"] == [201, 202, 203, 204, 205]


@pytest.mark.e2e
def test_agent_loop_manager_keeps_the_id_the_server_received(venv_python, patched, tmp_path):
    result = scenario(venv_python, patched("0.7.1"), "agent_loop", tmp_path)["agent_loop"]
    assert len(result["received"]) == 1
    assert result["token_output_extra_fields"]["request_id"] == result["received"][0]
    assert result["agent_loop_output_extra_fields"]["request_id"] == result["received"][0]


@pytest.mark.e2e
@pytest.mark.full  # an xfail canary: the 0.7.0 shape's codemod is proven by its fixtures (tests/codemods)
def test_agent_loop_070_cannot_be_imported_in_the_venv(venv_python, patched, tmp_path):
    """0.7.0 (TokenOutput without extra_fields) is covered by part 1 and the fixtures only."""
    proc = run_scenario(venv_python, patched("0.7.0"), "agent_loop", tmp_path)
    if proc.returncode == 0:  # the venv learned to import it: then the id must be there
        result = json.loads(proc.stdout.split("RESULT:")[-1])["agent_loop"]
        assert result["agent_loop_output_extra_fields"]["request_id"] == result["received"][0]
        return
    assert "AutoModelForVision2Seq" in proc.stderr, proc.stderr[-4000:]
    pytest.xfail(
        "verl 0.7.0 imports transformers.AutoModelForVision2Seq at module level, which the venv's "
        "transformers 5.10.4 no longer has: its agent loop cannot be imported here"
    )


@pytest.mark.e2e
def test_the_id_reaches_update_actor_log_through_the_real_engine(newest):
    """Stand-in server -> patched client -> DataProto -> prompts_forward -> real FSDPEngine -> jsonl;
    the trainer's own recompute on the full batch runs through the same engine undumped."""
    result = newest["chain"]
    assert "engine_skipped" not in result, result.get("engine_skipped")
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24]]
    assert result["engine_inputs"] == [prompts, result["full_input_ids"]]  # the copy, then the full batch
    assert result["input_ids_after"] == result["full_input_ids"] != prompts and result["same_object"]
    assert result["tq_request_id"] == result["received"]  # v1: a top-level field after verl's own packing
    lines = result["log_lines"]  # only the prompts-only forward is dumped: one line per micro-batch
    assert [line["request_ids"] for line in lines] == [[rid] for rid in result["received"]]
    assert all(line["phase"] == "log_prob" and line["num_requests"] == 1 for line in lines)


@pytest.mark.e2e
def test_prompts_only_copy_through_the_real_transfer_queue(newest):
    """v1 trainer (0.9.1): the batch is a KVBatchMeta in the real TransferQueue 0.1.11 (in-process
    Ray, ~45 s). The copy goes to its own partition, trimmed, read back as verl's worker bridge
    reads it, with the trainer's temperature; then it is cleared and the batch is untouched."""
    result = newest["tq"]
    seen = result["seen"]
    assert seen["partition_id"] == "rl_msprobe_prompts_only" and seen["partition_id"] != "train"
    assert seen["input_ids"] == [[5, 6, 7], [8, 9]] and seen["position_ids"] == [[0, 1, 2], [0, 1]]
    assert seen["responses"] == seen["response_mask"] == seen["rm_scores"] == [0, 0]
    assert seen["request_id"] == ["rid-0", "rid-1"]  # what the engine hook logs
    assert seen["temperature"] == 0.7 and seen["global_steps"] == 1
    assert result["same_object"] and result["batch_unchanged"]
    assert result["copy_left"] == [] and result["train_keys"] == ["u0_0_0", "u1_0_0"]


@pytest.mark.e2e
def test_request_ids_from_tensordict_non_tensor_fields(tmp_path):
    """A TensorDict micro-batch (the engine's input, in the verl venv: tensordict 0.10.0) with ids as a
    non-tensor stack, and with 0.8.0 main_ppo_sync's per-sample extra_fields."""
    import subprocess

    from tests.support import verl_venv

    python = verl_venv.venv_python_or_skip()
    code = (
        "import importlib.util, json, sys, torch, tensordict\n"
        "spec = importlib.util.spec_from_file_location('hooks', sys.argv[1])\n"
        "hooks = importlib.util.module_from_spec(spec); spec.loader.exec_module(hooks)\n"
        "td = tensordict.TensorDict({'input_ids': torch.ones(2, 3)}, batch_size=[2])\n"
        "td['request_id'] = tensordict.NonTensorStack('r0', 'r1')\n"
        "td2 = tensordict.TensorDict({'input_ids': torch.ones(2, 3)}, batch_size=[2])\n"
        "td2['extra_fields'] = tensordict.NonTensorStack({'request_id': 'e0'}, {'request_id': 'e1'})\n"
        "print(json.dumps([hooks.request_ids(td), hooks.request_ids(td2), hooks.request_ids(td2[1:])]))\n"
    )
    out = subprocess.run(
        [str(python), "-c", code, str(HELPER.with_name("rl_msprobe_hooks.py"))],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [["r0", "r1"], ["e0", "e1"], ["e1"]]

"""Behaviour of the verl-consistency patches, run for real inside the verl CPU test venv.

Run by tests/patches/files/test_verl_consistency.py with the venv's python and a verl tree patched by
rl-msprobe first on PYTHONPATH, one fresh process per case. Imports nothing from rl-msprobe.

    python consistency_scenario.py CASE[,CASE...] WORKDIR     # prints one line: RESULT:{json}

Cases:
  trim          PROMPTS_ONLY trimming on verl's own DataProto (2-D and 3-D position ids, optional
                keys absent), then verl's own to_tensordict() and left_right_2_no_padding().
  llm_server    the patched LLMServerClient.generate (and, where the file has it, the
                FullyAsyncLLMServerClient resume loop) against a stand-in rollout server.
  agent_loop    the patched AsyncLLMServerManager.generate (verl <= 0.7.1) against the stand-in.
  chain         0.9.x: stand-in server -> patched client -> DataProto.non_tensor_batch (as verl's
                agent loop builds it) -> prompts_forward (a trimmed copy) -> to_tensordict -> the
                REAL patched FSDPEngine.forward_backward_batch with DUMP_ON=1 ->
                update_actor_log.jsonl; then the full batch through the engine, undumped.
  tq            0.9.x: the v1 trainer's batch in the REAL TransferQueue (in-process Ray):
                prompts_forward's copy as verl's worker bridge reads it; the batch unchanged.

A Ray rollout server (vLLM / SGLang behind a Ray actor) cannot run here: the stand-in plays
the actor handle (`server.generate.remote(...)` returns an awaitable) and records the
request id it received. Server-side libraries that the client modules import but never use
here (uvicorn, fastapi, cachetools, hydra, torchdata) are replaced by inert stubs when the
venv lacks them; the result lists which.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

STUBBED: list[str] = []
SERVER_SIDE = ("uvicorn", "fastapi", "cachetools", "hydra", "torchdata")


# ---------------------------------------------------------------- import stand-ins


class _Inert:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __mro_entries__(self, bases):
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        STUBBED.append(spec.name)
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def stub_missing_server_libraries() -> None:
    missing = []
    for root in SERVER_SIDE:
        try:
            __import__(root)
        except ImportError:
            missing.append(root)
    if missing:
        sys.meta_path.append(_InertFinder(missing))


# ---------------------------------------------------------------- the stand-in rollout server


class StandInServer:
    """Plays a rollout server's Ray actor handle; `generate.remote(...)` is awaitable."""

    def __init__(self, replies=None):
        self.received: list[str] = []
        self.replies = list(replies or [])
        outer = self

        class _Generate:
            def remote(self, request_id, prompt_ids, sampling_params, **kwargs):
                outer.received.append(request_id)
                return outer._reply(request_id, prompt_ids)

            def options(self, **kwargs):
                return self

        self.generate = _Generate()

    async def _reply(self, request_id, prompt_ids):
        from verl.workers.rollout.replica import TokenOutput

        tokens, stop = self.replies.pop(0) if self.replies else ([101, 102, 103], "completed")
        fields = {"token_ids": tokens, "log_probs": [-0.5] * len(tokens), "stop_reason": stop}
        if "extra_fields" in TokenOutput.model_fields:
            fields["extra_fields"] = {"global_steps": 7}
        return TokenOutput(**fields)


def _extra(output) -> dict:
    return dict(getattr(output, "extra_fields", {}) or {})


# ---------------------------------------------------------------- cases


def case_trim(workdir: Path) -> dict:
    import numpy as np
    import torch
    from verl import DataProto
    from verl.utils import rl_msprobe_consistency as consistency

    def batch(mrope: bool, with_logprobs: bool) -> DataProto:
        prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
        prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        responses = torch.tensor([[11, 12, 0], [13, 14, 15]])
        response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)
        if mrope:
            position_ids = torch.stack([position_ids, position_ids + 100, position_ids + 200], dim=1)
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
        }
        if with_logprobs:
            tensors["rollout_log_probs"] = torch.full((2, 3), -0.25)
        non_tensors = {
            "request_id": np.array(["rid-a", "rid-b"], dtype=object),
            "uid": np.array(["u0", "u1"], dtype=object),
        }
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": 1.0})

    def describe(data: DataProto) -> dict:
        out = {k: {"shape": list(v.shape), "value": v.tolist()} for k, v in data.batch.items()}
        out["non_tensor"] = {k: list(v) for k, v in data.non_tensor_batch.items()}
        out["len"] = len(data)
        return out

    result = {}
    os.environ.pop("PROMPTS_ONLY", None)
    untouched = batch(mrope=False, with_logprobs=True)
    before = describe(untouched)
    same = consistency.trim_to_prompts(untouched)
    result["without_flag"] = {"same_object": same is untouched, "unchanged": describe(same) == before}

    os.environ["PROMPTS_ONLY"] = "1"
    for name, mrope, with_logprobs in (("2d", False, True), ("3d_no_logprobs", True, False)):
        data = batch(mrope, with_logprobs)
        original = describe(data)
        trimmed = consistency.trim_to_prompts(data)
        once = describe(trimmed)
        twice = describe(consistency.trim_to_prompts(trimmed))
        entry = {
            "before": original,
            "after": once,
            "idempotent": once == twice,
            "same_object": trimmed is data,
        }
        entry["meta_info"] = dict(trimmed.meta_info)
        try:  # what the trainer does next: DataProto -> TensorDict -> no-padding (engine input)
            from verl.workers.utils.padding import left_right_2_no_padding

            td = left_right_2_no_padding(trimmed.to_tensordict())
            entry["no_padding"] = {
                "input_ids": [row.tolist() for row in td["input_ids"].unbind()],
                "request_id": [str(x) for x in td["request_id"]],
            }
            # ... and back: the engine's per-token log-probs (one per prompt token) -> responses
            from verl.workers.utils.padding import no_padding_2_padding

            log_probs = torch.nested.nested_tensor_from_jagged(
                torch.zeros(td["input_ids"].values().shape[0]), offsets=td["input_ids"].offsets()
            )
            entry["old_log_probs_shape"] = list(no_padding_2_padding(log_probs, td).shape)
        except Exception as exc:  # reported, the test decides
            entry["no_padding_error"] = f"{type(exc).__name__}: {exc}"
        result[name] = entry
    return result


def _client_config():
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"name": "vllm", "response_length": 8, "full_determinism": False}
            },
            "async_training": {"partial_rollout": True},
        }
    )


def _stand_in_client(cls, server, **kwargs):
    client = cls(config=_client_config(), load_balancer_handle=None, **kwargs)

    async def acquire(request_id, **extra):  # the Ray load balancer's answer
        return "server-0", server

    client._acquire_server = acquire
    client._release_server = lambda server_id, **extra: None
    return client


async def _generate(client, request_id: str, prompt_ids):
    return await client.generate(
        request_id=request_id, prompt_ids=prompt_ids, sampling_params={"max_tokens": 8}
    )


def case_llm_server(workdir: Path) -> dict:
    os.environ["DUMP_ON"] = "1"
    stub_missing_server_libraries()
    from verl.workers.rollout import llm_server

    result = {"module": llm_server.__file__}
    server = StandInServer()
    client = _stand_in_client(llm_server.LLMServerClient, server)
    output = asyncio.run(_generate(client, "sample-0", [1, 2, 3]))
    result["client"] = {"received": server.received, "extra_fields": _extra(output)}

    fully_async = getattr(llm_server, "FullyAsyncLLMServerClient", None)
    if fully_async is None:  # 0.8.0: the class lives in fully_async_rollouter.py
        try:
            from verl.experimental.fully_async_policy import fully_async_rollouter

            fully_async = fully_async_rollouter.FullyAsyncLLMServerClient
        except Exception as exc:
            result["fully_async_error"] = f"{type(exc).__name__}: {exc}"
    if fully_async is not None:
        # first attempt aborted (weights sync), resumed: the first id is the prompt's prefill
        server = StandInServer(replies=[([201, 202], "aborted"), ([203, 204, 205], "completed")])
        client = _stand_in_client(fully_async, server)
        output = asyncio.run(_generate(client, "sample-1", [4, 5]))
        result["fully_async"] = {
            "received": server.received,
            "extra_fields": _extra(output),
            "token_ids": list(output.token_ids),
        }
    return result


def case_agent_loop(workdir: Path) -> dict:
    os.environ["DUMP_ON"] = "1"
    stub_missing_server_libraries()
    from verl.experimental.agent_loop import agent_loop
    from verl.utils import rl_msprobe_consistency as consistency

    server = StandInServer()
    manager = object.__new__(agent_loop.AsyncLLMServerManager)
    if hasattr(manager, "_acquire_server") or hasattr(agent_loop.AsyncLLMServerManager, "_acquire_server"):

        async def acquire(request_id):
            return "server-0", server

        manager._acquire_server = acquire
        manager._release_server = lambda server_id: None
    manager._choose_server = lambda request_id: server

    async def one_sample():
        # what the patched AgentLoopWorker._run_agent_loop does around agent_loop.run(...)
        consistency.begin_request()
        token_output = await manager.generate("sample-0", prompt_ids=[1, 2, 3], sampling_params={})
        output = agent_loop.AgentLoopOutput(
            prompt_ids=[1, 2, 3],
            response_ids=token_output.token_ids,
            response_mask=[1] * len(token_output.token_ids),
            num_turns=2,
            metrics={},
            extra_fields=_extra(token_output),
        )
        consistency.attach_request_id(output)
        return token_output, output

    token_output, output = asyncio.run(one_sample())
    return {
        "received": server.received,
        "token_output_extra_fields": _extra(token_output),
        "agent_loop_output_extra_fields": _extra(output),
    }


def case_chain(workdir: Path) -> dict:
    """Rollout id -> DataProto -> prompts_forward (a trimmed copy through a trainer's recompute) ->
    real engine micro-batches -> update_actor_log.jsonl; then the trainer's own recompute on the
    full batch, which PROMPTS_ONLY=1 leaves undumped."""
    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.update(DUMP_ON="1", PROMPTS_ONLY="1", DUMP_PHASE="log_prob")
    stub_missing_server_libraries()
    from verl import DataProto
    from verl.utils import rl_msprobe_consistency as consistency
    from verl.utils import tensordict_utils as tu
    from verl.workers.rollout import llm_server

    server = StandInServer(replies=[([31, 32], "completed"), ([41, 42], "completed")])
    client = _stand_in_client(llm_server.LLMServerClient, server)
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24]]
    outputs = [asyncio.run(_generate(client, f"sample-{i}", p)) for i, p in enumerate(prompts)]

    # verl's agent loop: each extra field becomes one object column of non_tensor_batch
    # (AgentLoopWorker._postprocess: `temp_arr[:] = [input.extra_fields.get(key) for input in inputs]`)
    request_id = np.empty(len(outputs), dtype=object)
    request_id[:] = [o.extra_fields.get("request_id") for o in outputs]
    prompt_t = torch.tensor(prompts)
    response_t = torch.tensor([o.token_ids for o in outputs])
    input_ids = torch.cat([prompt_t, response_t], dim=1)
    data = DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": response_t,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
            "response_mask": torch.ones_like(response_t),
        },
        non_tensors={"request_id": request_id},
    )
    full_input_ids = data.batch["input_ids"].tolist()

    def engine_input(batch):  # as RayPPOTrainer._compute_old_log_prob hands a batch to the engine
        td = batch.to_tensordict()
        td["loss_mask"] = torch.ones_like(td["input_ids"])
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        return td

    result = {"received": server.received}
    # the v1 trainer's path: samples as dicts -> verl's own TransferQueue packing
    fields = [
        consistency.lift_request_id({"extra_fields": dict(o.extra_fields), "uid": f"u{i}"})
        for i, o in enumerate(outputs)
    ]
    result["tq_request_id"] = [str(x) for x in tu.list_of_dict_to_tensordict(fields)["request_id"]]
    scenario_path = os.environ.get("RL_MSPROBE_ENGINE_SCENARIO", "")
    if not Path(scenario_path).is_file():
        result["engine_skipped"] = f"engine scenario not found at {scenario_path!r}"
        return result
    spec = importlib.util.spec_from_file_location("verl_engine_scenario", scenario_path)
    scenario = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scenario)

    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg'}", rank=0, world_size=1)
    try:
        engine = scenario._fsdp_engine("actor")
        seen = []

        class Trainer:  # a DataProto trainer: its old-log-prob recompute runs the real engine
            def _compute_old_log_prob(self, batch):
                td = engine_input(batch)
                seen.append(td["input_ids"].tolist())
                return engine.forward_backward_batch(td, loss_function=None, forward_only=True)

        trainer = Trainer()
        same = consistency.prompts_forward(trainer, data)  # the patched trainer line
        consistency.prompts_forward(trainer, data)  # a second patched line on the same batch: no-op
        trainer._compute_old_log_prob(data)  # the trainer's own recompute, on the full batch
        result["same_object"] = same is data
        result["engine_inputs"] = seen
        result["full_input_ids"] = full_input_ids
        result["input_ids_after"] = data.batch["input_ids"].tolist()
    finally:
        dist.destroy_process_group()
    logs = sorted(Path(os.environ["RL_MSPROBE_DUMP"]).rglob("update_actor_log.jsonl"))
    result["log_lines"] = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    return result


def case_tq(workdir: Path) -> dict:
    """The v1 trainer's batch in the REAL TransferQueue (in-process Ray): prompts_forward puts a
    trimmed copy under new keys, the stand-in worker group reads it the way verl's tqbridge does
    (transferqueue_utils._meta_to_realdata), the copy is cleared, the batch's own fields stay."""
    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf

    os.environ.update(PROMPTS_ONLY="1")
    from verl.utils import rl_msprobe_consistency as consistency
    from verl.utils import tensordict_utils as tu
    from verl.utils import transferqueue_utils

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        samples = []
        for i, (prompt, response) in enumerate((([5, 6, 7], [11, 12]), ([8, 9], [13, 14, 15, 16]))):
            input_ids = torch.tensor(prompt + response)
            samples.append(
                {  # what AgentLoopWorkerTQ._agent_loop_postprocess stores per sample
                    "prompts": torch.tensor(prompt),
                    "responses": torch.tensor(response),
                    "response_mask": torch.ones(len(response), dtype=torch.int64),
                    "loss_mask": torch.ones(len(response), dtype=torch.int64),
                    "rollout_log_probs": torch.full((len(response),), -0.5),
                    "rm_scores": torch.zeros(len(response)),
                    "input_ids": input_ids,
                    "position_ids": torch.arange(len(input_ids)),
                    "extra_fields": {"request_id": f"rid-{i}"},
                    "request_id": f"rid-{i}",
                    "uid": f"u{i}",
                }
            )
        keys = [f"u{i}_0_0" for i in range(len(samples))]
        batch = tq.kv_batch_put(
            keys=keys, partition_id="train", fields=tu.list_of_dict_to_tensordict(samples)
        )
        batch.extra_info = {"global_steps": 1}
        before = tq.kv_batch_get(keys=keys, partition_id="train")

        seen = {}

        class WorkerGroup:
            def compute_log_prob(self, meta):
                td = transferqueue_utils._meta_to_realdata(
                    meta
                )  # what the worker's tqbridge hands the engine
                seen["keys"] = list(meta.keys)
                seen["partition_id"] = meta.partition_id
                seen["input_ids"] = [row.tolist() for row in td["input_ids"].unbind()]
                seen["position_ids"] = [row.tolist() for row in td["position_ids"].unbind()]
                seen["responses"] = [row.numel() for row in td["responses"].unbind()]
                seen["response_mask"] = [row.numel() for row in td["response_mask"].unbind()]
                seen["rm_scores"] = [row.numel() for row in td["rm_scores"].unbind()]
                seen["request_id"] = [str(x) for x in td["request_id"]]
                seen["temperature"] = tu.get_non_tensor_data(td, "temperature", None)
                seen["global_steps"] = tu.get_non_tensor_data(td, "global_steps", None)
                return None

        trainer = types.SimpleNamespace(
            actor_rollout_wg=WorkerGroup(),
            config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"temperature": 0.7}}}),
        )
        same = consistency.prompts_forward(trainer, batch)
        after = tq.kv_batch_get(keys=keys, partition_id="train")
        unchanged = all(
            [r.tolist() for r in before[k].unbind()] == [r.tolist() for r in after[k].unbind()]
            for k in ("input_ids", "responses", "response_mask", "position_ids")
        )
        listed = tq.kv_list(consistency.PARTITION) or {}
        return {
            "seen": seen,
            "same_object": same is batch,
            "batch_unchanged": unchanged,
            "copy_left": sorted(listed.get(consistency.PARTITION, {})),
            "train_keys": sorted((tq.kv_list("train") or {}).get("train", {})),
        }
    finally:
        tq.close()
        ray.shutdown()


CASES = {
    "tq": case_tq,
    "trim": case_trim,
    "llm_server": case_llm_server,
    "agent_loop": case_agent_loop,
    "chain": case_chain,
}


def main() -> int:
    cases, workdir = sys.argv[1].split(","), Path(sys.argv[2])
    result = {}
    for case in cases:  # one process, several cases: importing verl costs most of the time
        (workdir / case).mkdir(parents=True, exist_ok=True)
        result[case] = CASES[case](workdir / case)
    result["stubbed"] = STUBBED
    import verl

    result["verl_file"] = verl.__file__
    print("RESULT:" + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One end-to-end scenario: the REAL (rl-msprobe-patched) verl training engine loop on CPU.

Run by tests/live/test_verl_engines_e2e.py with the verl test venv's python, in a fresh process
(msprobe's PrecisionDebugger is a per-process singleton and verl's EngineRegistry refuses a
second registration), with the patched verl copy first on PYTHONPATH. Imports nothing from
rl-msprobe: the venv does not have it.

    python verl_engine_scenario.py SPEC_JSON      # prints one JSON line prefixed RESULT:

SPEC: {"engine": "fsdp" | "megatron", "workdir": DIR,
       "calls": [{"role": "actor" | "ref", "forward_only": bool, "env": {NAME: VALUE | None}}, ...]}
Each call runs the engine's real `forward_backward_batch` over 4 samples in 2 micro-batches
(micro_batch_size_per_gpu=2) carrying a non-tensor `request_id` per sample
(`req-{call}-{sample}`); a call's "env" is applied to os.environ before it (None unsets). The
result tells, per call, the micro-batches' input ids, the number of losses, whether gradients
appeared, whether msprobe was imported by then, and the error if one was raised (type, message,
traceback text).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

VOCAB, HIDDEN, SEQ, SAMPLES, MICRO = 64, 32, 6, 4, 2


class TinyLM(nn.Module):
    """embed -> fc1 -> gelu -> fc2 (lm head): small, but with real named layers for msprobe."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, **_):
        return self.fc2(self.act(self.fc1(self.embed(input_ids))))


def _tensordict(call_index: int, sequences: list, **fields):
    """verl's TensorDict for the call, and each micro-batch's token ids (samples in order, MICRO
    per micro-batch) as the test expects to find them in the dumps."""
    import numpy as np
    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    request_ids = np.array([f"req-{call_index}-{i}" for i in range(SAMPLES)], dtype=object)
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": MICRO}
    if any(t.is_nested for t in fields.values()):  # DataProto holds no jagged tensors; 0.7.1 takes no arrays
        td = tu.get_tensordict({**fields, "request_id": request_ids.tolist()}, non_tensor_dict=meta)
    else:  # the trainer's way: DataProto.non_tensor_batch["request_id"] -> TensorDict
        td = DataProto.from_dict(tensors=fields, non_tensors={"request_id": request_ids}, meta_info=meta)
        td = td.to_tensordict()
    micro_ids = [torch.cat(sequences[i : i + MICRO]).tolist() for i in range(0, SAMPLES, MICRO)]
    return td, micro_ids


def _run(engine, model, batch, loss_function, forward_only: bool) -> dict:
    """The real (patched) forward_backward_batch over the call's batch."""
    td, micro_ids = batch
    out = engine.forward_backward_batch(td, loss_function=loss_function, forward_only=forward_only)
    grads = any(p.grad is not None for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    return {"losses": len(out["loss"]), "grads": grads, "micro_batch_ids": micro_ids}


def _padded_batch(call_index: int):
    """Padded (B, S) micro-batches, as the FSDP loop takes them here."""
    generator = torch.Generator().manual_seed(call_index)
    input_ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    mask = torch.ones(SAMPLES, SEQ, dtype=torch.int64)
    return _tensordict(call_index, list(input_ids), input_ids=input_ids, loss_mask=mask)


# ---------------------------------------------------------------- FSDP


def _fsdp2(model):
    """FSDP2 (`fully_shard`) on a one-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch
        from torch.distributed._composable.fsdp import fully_shard
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _fsdp_engine(role: str):
    """FSDPEngineWithLMHead without __init__ (DOMAIN §7), a stand-in forward_step on TinyLM."""
    from verl.workers.engine.fsdp import transformer_impl as impl

    impl.get_device_id = lambda: "cpu"  # 0.9.1 falls back to CUDA device ids on a CPU-only host
    torch.manual_seed(0)
    engine = object.__new__(impl.FSDPEngineWithLMHead)
    engine.module = _fsdp2(TinyLM())
    engine.engine_config = SimpleNamespace(
        forward_only=role == "ref", use_no_sync_for_gradient_accumulation=True
    )
    engine.ulysses_sequence_parallel_size = 1
    engine.ulysses_device_mesh = None
    engine.scaler = None
    engine.mode = None
    engine.rank = dist.get_rank()

    def forward_step(micro_batch, loss_function, forward_only):
        logits = engine.module(micro_batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), micro_batch["input_ids"].flatten())
        return loss, {"loss": loss.item(), "metrics": {}}

    engine.forward_step = forward_step
    return engine


def _run_fsdp(engine, call_index: int, forward_only: bool) -> dict:
    return _run(engine, engine.module, _padded_batch(call_index), None, forward_only)


def _qwen2_engine(role: str):
    """The real FSDPEngineWithLMHead.forward_step (verl's remove-padding inputs, log-prob head) on
    a random one-layer Qwen2 from transformers, FSDP2-sharded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    engine = _fsdp_engine(role)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4 * SEQ,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    engine.module = _fsdp2(model)
    del engine.forward_step  # the class's real forward_step from here on
    engine.engine_config.entropy_checkpointing = False
    engine.engine_config.entropy_from_logits_with_chunking = False
    engine.use_ulysses_sp = False
    engine.pad_to_length = False
    engine._autocast_dtype = torch.float32
    return engine


def _packed_batch(call_index: int):
    """NO_PADDING micro-batches (jagged input_ids / position_ids), as verl's engines take them."""
    generator = torch.Generator().manual_seed(call_index)
    lengths = [SEQ - (i % 2) for i in range(SAMPLES)]
    ids = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    jagged = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return _tensordict(
        call_index,
        ids,
        input_ids=jagged(ids),
        position_ids=jagged([torch.arange(n) for n in lengths]),
        loss_mask=jagged([torch.ones(n, dtype=torch.int64) for n in lengths]),
        temperature=torch.ones(SAMPLES),
    )


def _mean_log_prob_loss(model_output, data, dp_group=None):
    log_probs = model_output["log_probs"]
    values = log_probs.values() if log_probs.is_nested else log_probs
    loss = -values.float().mean()
    return loss, {"neg_log_prob": loss.item()}


def _run_qwen2(engine, call_index: int, forward_only: bool) -> dict:
    return _run(engine, engine.module, _packed_batch(call_index), _mean_log_prob_loss, forward_only)


# ---------------------------------------------------------------- Megatron


class TinyMcoreLM(TinyLM):
    """TinyLM with what megatron-core's schedule and verl's mcore forward read: `.config` (a
    TransformerConfig), `.model_type`, `pre_process` / `post_process`, `set_input_tensor`."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = self.post_process = True

    def set_input_tensor(self, input_tensor):
        pass

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **_):
        return super().forward(input_ids)  # THD: (1, total_tokens) -> (1, total_tokens, vocab)


class _CpuTorch:
    """`torch` as megatron-core's schedules module sees it, with device="cuda" sent to the CPU:
    forward_backward_no_pipelining allocates its token counter with a hard-coded device="cuda"."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _megatron_engine(role: str):
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig
    from verl.workers.engine.megatron import transformer_impl as impl

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    schedules.torch = _CpuTorch()
    impl.get_device_id = lambda: "cpu"
    tf_config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    torch.manual_seed(0)
    engine = object.__new__(impl.MegatronEngineWithLMHead)
    engine.module = [TinyMcoreLM(tf_config)]
    engine.tf_config = tf_config
    engine.engine_config = SimpleNamespace(
        forward_only=role == "ref",
        context_parallel_size=1,
        dynamic_context_parallel=False,
        pad_bshd_to_minibatch_max=False,
        use_remove_padding=True,
        use_fused_kernels=False,
        pad_to_length=False,
        pad_to_length_bucket=None,
        router_replay=SimpleNamespace(mode="disabled"),
        entropy_from_logits_with_chunking=False,
        virtual_pipeline_model_parallel_size=None,
    )
    engine.model_config = SimpleNamespace(
        model_type="language_model",
        mtp=SimpleNamespace(enable=False, enable_train=False),
        hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        lora={},
    )
    engine.enable_routing_replay = False
    engine.mini_layer_topk_idx_list = []
    return engine


def _run_megatron(engine, call_index: int, forward_only: bool) -> dict:
    return _run(engine, engine.module[0], _packed_batch(call_index), _mean_log_prob_loss, forward_only)


# ---------------------------------------------------------------- main


def _error(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    workdir = spec["workdir"]
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'pg-rendezvous')}", rank=0, world_size=1
    )
    import verl

    make, run = {
        "fsdp": (_fsdp_engine, _run_fsdp),
        "fsdp-qwen2": (_qwen2_engine, _run_qwen2),
        "megatron": (_megatron_engine, _run_megatron),
    }[spec["engine"]]
    result = {"verl_file": verl.__file__, "calls": [], "error": None}
    engines = {}
    try:
        for index, call in enumerate(spec["calls"]):
            for name, value in call.get("env", {}).items():  # the hooks read the environment per call
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            role = call["role"]
            if role not in engines:
                engines[role] = make(role)
            record = dict(call, error=None)
            try:
                record.update(run(engines[role], index, call["forward_only"]))
            except Exception as exc:  # reported per call; the test decides
                record["error"] = _error(exc)
            record["msprobe_imported"] = "msprobe" in sys.modules
            result["calls"].append(record)
    except Exception as exc:  # set-up failed
        result["error"] = _error(exc)
    result["msprobe_imported"] = "msprobe" in sys.modules
    print("RESULT:" + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

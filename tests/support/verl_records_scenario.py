"""The training side's per-token records (RL_MSPROBE_RECORD_DIR) on the REAL verl FSDP engine.

Run by tests/patches/files/test_verl_train_records.py (and benchmarks/bench_train_records.py)
with the verl test venv's python, in a fresh process, the rl-msprobe-patched verl copy first on
PYTHONPATH. Imports nothing from rl-msprobe.

    python verl_records_scenario.py SPEC_JSON      # prints one JSON line prefixed RESULT:

The engine: `FSDPEngineWithLMHead` (its real `forward_backward_batch`, `prepare_model_inputs`,
`forward_step`, `prepare_model_outputs`) over a random 2-layer transformers Qwen2 (fp32),
FSDP2-sharded on a one-rank gloo CPU mesh (DOMAIN §7). The batch: SAMPLES requests of different
prompt / response lengths, nested (verl's no-padding layout: each sample its valid prompt then
response tokens), a non-tensor `request_id` per sample (`req-{call}-{i}`), split by verl's own
`prepare_micro_batches` (MICRO samples each, or by a token budget with use_dynamic_bsz).

SPEC: {"workdir": DIR, "calls": [{"role": "actor" | "ref", "forward_only": bool,
        "remove_padding": bool, "dynamic": bool, "env": {NAME: VALUE | None}}, ...],
       "reference": bool, "bench": {"repeat": N} | absent}
Result: whether this verl's forward_step always autocasts to bf16 (0.7.1; the reference then
runs under the same autocast). Per call: the samples (id, prompt, response token ids), the micro-batches' request ids, the
error if one was raised, whether msprobe was imported. With "reference": per request, a forward
of the same model on that request alone ([1, P+R], positions 0..P+R-1): the per-row Max, Min and
L2 norm of `model.layers.0.mlp.down_proj`'s output and of `lm_head`'s output. With "bench": the
log-prob forward's seconds, recorded and not, alternating (RL_MSPROBE_RECORD_DIR set / unset).
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from verl_engine_scenario import _error  # beside this file: one spelling of a reported error

VOCAB, HIDDEN, LAYERS = 96, 64, 2
PROMPTS = (3, 5, 2, 4, 6, 3)
RESPONSES = (4, 2, 5, 3, 1, 6)
MICRO = 3
TOKEN_BUDGET = 16  # use_dynamic_bsz: max_token_len_per_gpu


def _model(vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _engine(role: str, **model):
    from verl.utils import seqlen_balancing
    from verl.workers.engine.fsdp import transformer_impl as impl

    impl.get_device_id = lambda: "cpu"
    seqlen_balancing.get_device_name = lambda: "cpu"  # use_dynamic_bsz's counts, on a CPU-only host
    engine = object.__new__(impl.FSDPEngineWithLMHead)
    engine.module = _fsdp2(_model(**model))
    engine.engine_config = SimpleNamespace(
        forward_only=role == "ref",
        use_no_sync_for_gradient_accumulation=True,
        entropy_checkpointing=False,
        entropy_from_logits_with_chunking=False,
    )
    engine.ulysses_sequence_parallel_size = 1
    engine.ulysses_device_mesh = None
    engine.use_ulysses_sp = False
    engine.pad_to_length = False
    engine.scaler = None
    engine.mode = None
    engine.rank = dist.get_rank()
    engine._autocast_dtype = torch.float32
    return engine


def _samples(call: int, scale: int = 1, vocab: int = VOCAB) -> list:
    """SAMPLES requests: prompt and response lengths PROMPTS / RESPONSES (times SCALE)."""
    generator = torch.Generator().manual_seed(100 + call)
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        p, r = p * scale, r * scale
        ids = torch.randint(1, vocab, (p + r,), generator=generator)
        out.append({"id": f"req-{call}-{i}", "prompt": ids[:p].tolist(), "response": ids[p:].tolist()})
    return out


def _batch(samples: list, remove_padding: bool, dynamic: bool):
    from verl.utils import tensordict_utils as tu

    ids = [torch.tensor(s["prompt"] + s["response"]) for s in samples]

    def jagged(ts):
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    meta = {
        "use_dynamic_bsz": dynamic,
        "micro_batch_size_per_gpu": MICRO,
        "use_remove_padding": remove_padding,
    }
    if dynamic:
        meta["max_token_len_per_gpu"] = TOKEN_BUDGET
    return tu.get_tensordict(
        {
            "input_ids": jagged(ids),
            "position_ids": jagged([torch.arange(len(t)) for t in ids]),
            "loss_mask": jagged(
                [torch.tensor([0] * len(s["prompt"]) + [1] * len(s["response"])) for s in samples]
            ),
            "temperature": torch.ones(len(samples)),
            "request_id": [s["id"] for s in samples],
        },
        non_tensor_dict=meta,
    )


def _loss(model_output, data, dp_group=None):
    log_probs = model_output["log_probs"]
    values = log_probs.values() if log_probs.is_nested else log_probs
    loss = -values.float().mean()
    return loss, {"neg_log_prob": loss.item()}


def _micro_ids(batch) -> list:
    """The micro-batches' request ids, as the engine's own prepare_micro_batches groups them."""
    from verl.workers.engine.utils import prepare_micro_batches

    micro, _ = prepare_micro_batches(data=batch.clone(), dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
    return [list(tu_list(m["request_id"])) for m in micro]


def tu_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def bf16_autocast() -> bool:
    """Does this verl's forward_step always autocast to bf16 (0.7.1), whatever the parameters' dtype?"""
    import inspect

    from verl.workers.engine.fsdp import transformer_impl as impl

    return "_autocast_dtype" not in inspect.getsource(impl.FSDPEngineWithLMHead.forward_step)


def _autocast():
    from contextlib import nullcontext

    return torch.autocast(device_type="cpu", dtype=torch.bfloat16) if bf16_autocast() else nullcontext()


def _reference(engine, samples: list) -> dict:
    """Each request alone through the same model: per-row stats of down_proj (layer 0) and lm_head."""
    model = engine.module
    seen = {}
    hooks = [
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, a, o: seen.__setitem__("down", o)
        ),
        model.lm_head.register_forward_hook(lambda m, a, o: seen.__setitem__("lm_head", o)),
    ]
    out = {}
    with torch.no_grad(), _autocast():
        for s in samples:
            ids = torch.tensor([s["prompt"] + s["response"]])
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), use_cache=False)
            out[s["id"]] = {
                name: {
                    "Max": value[0].amax(-1).tolist(),
                    "Min": value[0].amin(-1).tolist(),
                    "Norm": torch.linalg.vector_norm(value[0], dim=-1).tolist(),
                }
                for name, value in seen.items()
            }
    for hook in hooks:
        hook.remove()
    return out


def _bench(spec: dict, record_dir: str) -> dict:
    """The log-prob forward_backward_batch of one batch, in turn: not recorded, every request
    recorded, one request of SAMPLES recorded. Seconds per mode, after a warm-up round."""
    model = {k: spec[k] for k in ("vocab", "hidden", "layers") if k in spec}
    engine = _engine("actor", **model)
    samples = _samples(0, spec.get("scale", 1), model.get("vocab", VOCAB))
    batch = _batch(samples, spec.get("remove_padding", True), False)
    modes = {"off": None, "all": "", "one": samples[0]["id"]}
    times: dict = {mode: [] for mode in modes}
    for round_ in range(1 + spec["repeat"]):
        for mode, ids in modes.items():
            os.environ.pop("RL_MSPROBE_RECORD_DIR", None)
            os.environ.pop("RL_MSPROBE_RECORD_IDS", None)
            if ids is not None:
                os.environ["RL_MSPROBE_RECORD_DIR"] = record_dir
                os.environ["RL_MSPROBE_RECORD_IDS"] = ids
            start = time.perf_counter()
            engine.forward_backward_batch(batch.clone(), loss_function=_loss, forward_only=True)
            if round_:
                times[mode].append(time.perf_counter() - start)
    os.environ.pop("RL_MSPROBE_RECORD_DIR", None)
    os.environ.pop("RL_MSPROBE_RECORD_IDS", None)
    return {"seconds": times, "tokens": sum(len(x["prompt"]) + len(x["response"]) for x in samples)}


def _sp_layouts(sizes: list) -> list:
    """Ulysses SP without a second process: verl's own prepare_model_inputs (pad to a multiple of
    the SP size, then this rank's slice) with verl.utils.ulysses told the SP group has SIZE ranks and
    this is rank R; then the helper's layout for the same rank. Returns, per (size, rank, request),
    the token ids and position ids the model inputs hold at the rows the layout names."""
    from verl.utils import rl_msprobe_hooks as hooks
    from verl.utils import ulysses

    engine = _engine("actor")
    samples = _samples(0)
    batch = _batch(samples, True, False)
    ids = [s["id"] for s in samples]
    out = []
    saved = (
        ulysses.get_ulysses_sequence_parallel_group,
        ulysses.get_ulysses_sequence_parallel_rank,
        ulysses.dist,
    )
    try:
        for size in sizes:
            for rank in range(size):
                ulysses.get_ulysses_sequence_parallel_group = lambda: "sp-group"
                ulysses.get_ulysses_sequence_parallel_rank = lambda group=None, r=rank: r
                ulysses.dist = SimpleNamespace(get_world_size=lambda group=None, n=size: n)
                engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = size, True
                engine.ulysses_device_mesh = {"sp": SimpleNamespace(get_local_rank=lambda r=rank: r)}
                inputs, _ = engine.prepare_model_inputs(batch)
                layout, meta = hooks.fsdp_layout(engine, batch, ids)
                tokens, positions = inputs["input_ids"][0], inputs["position_ids"][0]
                row = 0
                for (request, first, count), rows in zip(
                    layout.token_rows, _split(layout.token_index, [c for _, _, c in layout.token_rows])
                ):
                    out.append(
                        {
                            "size": size,
                            "rank": rank,
                            "meta": meta,
                            "total": layout.total,
                            "rows_in_input": int(tokens.shape[0]),
                            "request": layout.requests[request],
                            "first": first,
                            "tokens": tokens[rows].tolist(),
                            "positions": positions[rows].tolist(),
                        }
                    )
                    row += count
    finally:
        (
            ulysses.get_ulysses_sequence_parallel_group,
            ulysses.get_ulysses_sequence_parallel_rank,
            ulysses.dist,
        ) = saved
    return out


def _split(index: list, counts: list) -> list:
    parts, at = [], 0
    for n in counts:
        parts.append(index[at : at + n])
        at += n
    return parts


def _megatron_layouts(tp_sizes: list) -> list:
    """Megatron THD packing without Megatron's model: verl's own preprocess_thd_engine (each sample
    aligned to the TP size) with parallel_state told the TP size, then a module called as verl's
    mcore forward calls the model chunk (input_ids=[1, rows], packed_seq_params=...), recorded by the
    helper's Megatron recorder. Returns each record's header and its embedding input (token ids)."""
    from megatron.core import parallel_state as mpu
    from torch import nn
    from verl.models.mcore import util
    from verl.utils import rl_msprobe_hooks as hooks

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8)])
            self.layers[0].layer_number = 3  # as on a later pipeline stage: global layer 2

        def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None):
            return self.layers[0](self.embedding(input_ids))

    samples = _samples(0)
    batch = _batch(samples, True, False)
    engine = SimpleNamespace(rank=0, engine_config=SimpleNamespace(forward_only=False))
    names = (
        "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank",
        "get_pipeline_model_parallel_rank",
        "get_pipeline_model_parallel_world_size",
        "get_context_parallel_world_size",
        "get_context_parallel_rank",
    )
    saved = {name: getattr(mpu, name) for name in names}
    out = []
    try:
        for tp in tp_sizes:
            values = dict(zip(names, (tp, tp - 1, 1, 2, 1, 0)))
            for name, value in values.items():
                setattr(mpu, name, lambda *a, v=value, **k: v)
            input_ids, params, _ = util.preprocess_thd_engine(batch["input_ids"], pre_process=True)
            chunk = Chunk()
            recorder = hooks._megatron_recorder(engine, chunk, batch)
            with torch.no_grad():
                chunk(input_ids=input_ids.unsqueeze(0), packed_seq_params=params)
            path = recorder.finish()
            header = _load_header(path)
            values = np.fromfile(path[: -len(".json")] + ".f32", dtype="<f4")
            embedding = next(
                t
                for t in header["tensors"]
                if t["key"].startswith("Module.embedding.") and t["label"] == "input.0"
            )
            rows = sum(c for _, _, c in header["token_rows"])
            out.append(
                {
                    "tp": tp,
                    "header": {k: v for k, v in header.items() if k != "tensors"},
                    "keys": sorted({t["key"] for t in header["tensors"]}),
                    "tokens": values[embedding["offset"] : embedding["offset"] + rows].tolist(),
                    "packed_rows": int(input_ids.shape[-1]),
                }
            )
    finally:
        for name, value in saved.items():
            setattr(mpu, name, value)
    return out


def _load_header(path: str) -> dict:
    """A record header with its tensor table (schema{S}.json beside it) inlined, offsets included
    (the job venv's interpreter runs this file: tests.support.records is not importable there)."""
    import os

    with open(path, encoding="utf-8") as handle:
        header = json.load(handle)
    with open(
        os.path.join(os.path.dirname(path), f"schema{header['schema']}.json"), encoding="utf-8"
    ) as handle:
        table = json.load(handle)["tensors"]
    counts = {"token": sum(c for _, _, c in header["token_rows"]), "sample": len(header["sample_rows"])}
    offset = 0
    header["tensors"] = []
    for tensor in table:
        header["tensors"].append({**tensor, "offset": offset})
        offset += 3 * counts[tensor["rows"]]
    return header


def main() -> int:
    spec = json.loads(sys.argv[1])
    workdir = spec["workdir"]
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'pg-rendezvous')}", rank=0, world_size=1
    )
    import verl

    result = {"verl_file": verl.__file__, "calls": [], "error": None, "bf16_autocast": bf16_autocast()}
    engines: dict = {}
    try:
        for index, call in enumerate(spec.get("calls", [])):
            for name, value in call.get("env", {}).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            role = call["role"]
            if role not in engines:
                engines[role] = _engine(role)
            engine = engines[role]
            samples = _samples(index)
            batch = _batch(samples, call.get("remove_padding", True), call.get("dynamic", False))
            record = dict(call, samples=samples, micro_batches=_micro_ids(batch), error=None)
            try:
                out = engine.forward_backward_batch(
                    batch, loss_function=_loss, forward_only=call["forward_only"]
                )
                record["losses"] = len(out["loss"]) if isinstance(out, dict) else None
            except Exception as exc:
                record["error"] = _error(exc)
            for p in engine.module.parameters():
                p.grad = None
            if spec.get("reference"):
                record["reference"] = _reference(engine, samples)
            record["msprobe_imported"] = "msprobe" in sys.modules
            result["calls"].append(record)
        if "sp_layout" in spec:
            result["sp_layout"] = _sp_layouts(spec["sp_layout"])
        if "megatron_layout" in spec:
            result["megatron_layout"] = _megatron_layouts(spec["megatron_layout"])
        if "bench" in spec:
            result["bench"] = _bench(spec["bench"], os.path.join(workdir, "bench-records"))
    except Exception as exc:
        result["error"] = _error(exc)
    result["msprobe_imported"] = "msprobe" in sys.modules
    print("RESULT:" + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

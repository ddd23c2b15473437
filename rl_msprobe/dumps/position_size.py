"""How big the dumps of a whole-response compare get, said before the job runs (docs/whole-response.md).

One request: the rollout's prefill (P rows) and its R-1 decode steps, and the training forward
over P+R rows. Per dumped module, msprobe writes (tensor mode, L0) every input and output tensor
and, at every step, the module's parameters; in statistics mode one JSON leaf per tensor.
The per-file and per-leaf costs are measured on msprobe 26.2.0 (benchmarks/bench_positions.py,
vLLM-named modules: a `torch.save` file costs its data plus ~2.3 KiB, most of it the archive's
member names; a dump.json leaf 0.32 KiB in statistics mode, 0.41 KiB in tensor mode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rl_msprobe.errors import UserError

PT_OVERHEAD = 2340  # bytes a torch.save file costs beyond its data (measured, small tensors)
LEAF_JSON = {"statistics": 320, "tensor": 413}  # bytes of dump.json per tensor leaf, measured
GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, object], where: str = "config.json") -> ModelShape:
        """From a Hugging Face config.json (Qwen2 / Llama keys)."""

        def get(key: str, default: int | None = None) -> int:
            v = config.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(
                    f"{where}: `{key}` is {v!r}; a positive integer is needed to estimate the dump size."
                )
            return v

        hidden, heads = get("hidden_size"), get("num_attention_heads")
        return cls(
            hidden=hidden,
            intermediate=get("intermediate_size"),
            layers=get("num_hidden_layers"),
            heads=heads,
            kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", hidden // heads),
            vocab=get("vocab_size"),
        )

    def modules(self) -> dict[str, tuple[list[int], list[int], int]]:
        """Per decoder layer, vLLM's module names: (input widths, output widths, parameters)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "input_layernorm": ([h], [h], h),
            "qkv_proj": ([h], [q + 2 * kv], (q + 2 * kv) * (h + 1)),
            "attn": ([q, kv, kv], [q], 0),
            "o_proj": ([q], [h], h * q),
            "self_attn": ([h], [h], 0),
            "post_attention_layernorm": ([h], [h], h),
            "gate_up_proj": ([h], [2 * i], 2 * i * h),
            "act_fn": ([2 * i], [i], 0),
            "down_proj": ([i], [h], h * i),
            "mlp": ([h], [h], 0),
            "decoder_layer": ([h], [h], 0),
        }


# modules a whole-response compare dumps by default: the layer's projections, norms and blocks
DEFAULT_MODULES = (
    "input_layernorm",
    "qkv_proj",
    "o_proj",
    "post_attention_layernorm",
    "gate_up_proj",
    "down_proj",
)

# Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B-Instruct)
QWEN2_5_7B = ModelShape(
    hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064
)


@dataclass(frozen=True)
class SizeEstimate:
    rollout_prefill: int
    rollout_decode: int
    train: int
    files: int

    @property
    def total(self) -> int:
        return self.rollout_prefill + self.rollout_decode + self.train

    def describe(self) -> str:
        return (
            f"estimated dump size for one request: {self.total / GIB:.3g} GiB (rollout prefill "
            f"{self.rollout_prefill / GIB:.3g}, decode steps {self.rollout_decode / GIB:.3g}, training "
            f"forward {self.train / GIB:.3g}; {self.files} tensor files)"
        )


def estimate(
    shape: ModelShape,
    prompt: int,
    response: int,
    *,
    modules: Sequence[str] = DEFAULT_MODULES,
    layers: Sequence[int] | None = None,
    dtype_bytes: int = 2,
    decode_task: str = "statistics",
    head: bool = False,
) -> SizeEstimate:
    """Bytes of one request's dumps (module doc): MODULES of LAYERS (default all) and the
    embedding (its input is the token ids), the prefill and the training forward in tensor
    mode, the decode steps in DECODE_TASK (statistics: one JSON leaf per tensor and step;
    tensor: each step's row and, as msprobe writes them, the modules' weights again). HEAD: the
    final norm and lm_head too (the logits: a vocabulary-wide row per token)."""
    table = shape.modules()
    unknown = [m for m in modules if m not in table]
    if unknown:
        raise UserError(f"module(s) {', '.join(unknown)}: not one of {', '.join(table)}.")
    n = len(layers) if layers is not None else shape.layers
    # activations: tensors and elements per row; weights: files and elements; embedding included
    acts = n * sum(len(table[m][0]) + len(table[m][1]) for m in modules) + 2
    width = n * sum(sum(table[m][0]) + sum(table[m][1]) for m in modules) + 1 + shape.hidden
    weights = n * sum(1 for m in modules if table[m][2]) + 1
    params = n * sum(table[m][2] for m in modules) + shape.vocab * shape.hidden
    if head:
        acts, width = acts + 4, width + 3 * shape.hidden + shape.vocab
        weights, params = weights + 2, params + shape.hidden + shape.vocab * shape.hidden
    leaves = acts + weights

    def forward(rows: int, tensor: bool) -> int:
        data = (rows * width + params) * dtype_bytes + leaves * PT_OVERHEAD if tensor else 0
        return leaves * LEAF_JSON["tensor" if tensor else "statistics"] + data

    steps = max(response - 1, 0)
    decode_tensor = decode_task == "tensor"
    files = leaves * (2 + (steps if decode_tensor else 0))
    return SizeEstimate(
        forward(prompt, True), steps * forward(1, decode_tensor), forward(prompt + response, True), files
    )


# The whole-response run as `prepare --mode consistency` writes it (docs/whole-response.md): the
# rollout dumps every step in statistics mode (as consistency mode always did), the actor writes
# one per-token record per request. Bytes per decoder layer, measured on msprobe 26.2.0:
# one rollout step's dump folder (dump.json, stack.json, construct.json) per level: mix on the
# live tp2 job (vLLM CPU, Qwen2 2 layers, FOCUS risk: 302 KB per step and TP rank), L0 on the
# stand-in (tests/dumps/position_standin.py, 68 KB per step); L1 is taken as mix
ROLLOUT_STEP_PER_LAYER = {"mix": 151_000, "L1": 151_000, "L0": 34_000}
RECORD_PER_TOKEN_PER_LAYER = 1_950  # the live tp2 job: 2.67 MB for 16 requests of ~43 tokens, 2 layers


@dataclass(frozen=True)
class WholeResponseSize:
    """One training step's whole-response dumps: REQUESTS requests of PROMPT + RESPONSE tokens."""

    requests: int
    tp: int  # rollout TP ranks: each dumps every step
    rollout: (
        int  # every step's statistics: the prefill and RESPONSE - 1 decode steps, per request and TP rank
    )
    records: int  # the actor's per-token records

    @property
    def total(self) -> int:
        return self.rollout + self.records

    def describe(self) -> str:
        return (
            f"estimated dump per training step ({self.requests} request(s), rollout TP {self.tp}): "
            f"{self.total / GIB:.3g} GiB (rollout steps {self.rollout / GIB:.3g}, every step on every TP rank, "
            f"as consistency runs always dumped them; per-token records {self.records / GIB:.3g})"
        )


def whole_response(
    layers: int, prompt: int, response: int, requests: int = 1, level: str = "mix", tp: int = 1
) -> WholeResponseSize:
    """The size of one training step's whole-response dumps (module doc); LAYERS: decoder layers,
    TP: the rollout's tensor-parallel ranks."""
    if min(layers, prompt, response, requests, tp) < 1:
        raise UserError(
            "layers, prompt, response, requests and TP must be at least 1 to estimate the dump size."
        )
    per_step = ROLLOUT_STEP_PER_LAYER.get(level, ROLLOUT_STEP_PER_LAYER["mix"]) * layers
    rollout = tp * requests * response * per_step  # one prefill and response - 1 decode steps
    records = requests * (prompt + response) * layers * RECORD_PER_TOKEN_PER_LAYER
    return WholeResponseSize(requests, tp, rollout, records)


# ---------------------------------------------------------------------------------------------
# Per-token records (docs/records.md): what `prepare --mode consistency` plans by default.
#
# Each side writes, for every recorded module call, 3 float32 (Max, Min, L2 norm) per tensor
# input / output and per token row of a selected request. The tensors per token are counted
# from the model's config.json with the table below: the modules of one decoder layer as the
# rollout engine (vLLM / SGLang: fused qkv and gate_up, rotary and attention modules, the
# fused add-norms taking and giving the residual) and the trainer (Hugging Face: separate
# q/k/v and gate/up projections) call them, each with its tensor inputs and outputs.

RECORD_FLOAT_BYTES = 12  # 3 float32 per tensor and row
# Multiplies every record estimate: 1.0 until a live job's measured record bytes say otherwise
# (measured bytes / estimated bytes of the same run; the one line to change when calibrating).
RECORD_CALIBRATION = 1.0

# (module, tensor inputs, tensor outputs) per decoder layer; "moe" rows replace "mlp" rows on
# mixture-of-experts models, "qk_norm" rows are added where the attention normalises q and k.
ENGINE_LAYER: tuple[tuple[str, str, int, int], ...] = (
    ("layer", "all", 3, 2),  # positions, hidden, residual -> hidden, residual
    ("input_layernorm", "all", 2, 2),  # fused add + RMSNorm: x, residual -> out, residual
    ("self_attn", "all", 2, 1),  # positions, hidden -> out
    ("qkv_proj", "all", 1, 1),
    ("q_norm", "qk_norm", 1, 1),
    ("k_norm", "qk_norm", 1, 1),
    ("rotary_emb", "all", 3, 2),  # positions, q, k -> q, k
    ("attn", "all", 3, 1),  # q, k, v -> out
    ("o_proj", "all", 1, 1),
    ("post_attention_layernorm", "all", 2, 2),
    ("mlp", "all", 1, 1),
    ("gate_up_proj", "dense", 1, 1),
    ("act_fn", "dense", 1, 1),
    ("down_proj", "dense", 1, 1),
    ("gate", "moe", 1, 1),  # the router: hidden -> router logits
    ("experts", "moe", 2, 1),  # fused experts: hidden, router logits -> out (one row per token)
)
TRAINER_LAYER: tuple[tuple[str, str, int, int], ...] = (
    ("layer", "all", 3, 1),  # hidden, cos, sin -> hidden
    ("input_layernorm", "all", 1, 1),
    ("self_attn", "all", 3, 1),  # hidden, cos, sin -> out
    ("q_proj", "all", 1, 1),
    ("k_proj", "all", 1, 1),
    ("v_proj", "all", 1, 1),
    ("q_norm", "qk_norm", 1, 1),
    ("k_norm", "qk_norm", 1, 1),
    ("o_proj", "all", 1, 1),
    ("post_attention_layernorm", "all", 1, 1),
    ("mlp", "dense", 1, 1),
    ("gate_proj", "dense", 1, 1),
    ("up_proj", "dense", 1, 1),
    ("act_fn", "dense", 1, 1),
    ("down_proj", "dense", 1, 1),
    ("mlp", "moe", 1, 2),  # the sparse block: hidden -> hidden, router logits
    ("gate", "moe", 1, 1),
    ("experts", "moe", 3, 1),  # hidden, top-k indices, top-k weights -> out (one row per token)
)
# outside every layer: embedding (token ids in, rows out), final norm, logits (and HF's rotary)
ENGINE_GLOBAL = 2 + 4 + 2
TRAINER_GLOBAL = 2 + 4 + 2 + 2


@dataclass(frozen=True)
class RecordModel:
    """What the record count needs from a config.json (planner.model_config reads it)."""

    layers: int
    heads: int
    kv_heads: int
    hidden: int
    experts: int = 0  # routed experts (0: a dense model)
    qk_norm: bool = False  # q_norm / k_norm in the attention (Qwen3)
    model_type: str = ""


def tensors_per_token(model: RecordModel, side: str, layers: int | None = None) -> int:
    """Recorded tensors per token row on SIDE ("rollout" or "train"): LAYERS decoder layers
    (default: all) of the table's modules, plus the modules outside every layer."""
    table, outside = (ENGINE_LAYER, ENGINE_GLOBAL) if side == "rollout" else (TRAINER_LAYER, TRAINER_GLOBAL)
    kinds = {"all", "moe" if model.experts else "dense"} | ({"qk_norm"} if model.qk_norm else set())
    per_layer = sum(ins + outs for _, kind, ins, outs in table if kind in kinds)
    return per_layer * (model.layers if layers is None else layers) + outside


@dataclass(frozen=True)
class RecordSize:
    """One dumped training step's per-token records: REQUESTS requests of TOKENS tokens each."""

    requests: float
    tokens: int  # prompt + response: every position of the whole response
    rollout_tp: int  # every rollout TP rank writes its shard's rows
    train_tp: int  # Megatron: every actor TP rank writes its shard's rows
    rollout: int  # bytes
    train: int
    steps: int = 1

    @property
    def per_step(self) -> int:
        return self.rollout + self.train

    @property
    def run(self) -> int:
        return self.per_step * self.steps

    def describe(self) -> str:
        requests = f"{self.requests:g}" if self.requests != int(self.requests) else str(int(self.requests))
        return (
            f"estimated records per dumped step: {self.per_step / GIB:.3g} GiB ({requests} request(s) x "
            f"{self.tokens} tokens, every position of the whole response; rollout {self.rollout / GIB:.3g} GiB "
            f"on {self.rollout_tp} TP rank(s), training {self.train / GIB:.3g} GiB); for the run "
            f"({self.steps} dumped step(s)): {self.run / GIB:.3g} GiB"
        )


def records(
    model: RecordModel,
    requests: float,
    tokens: int,
    rollout_tp: int = 1,
    train_tp: int = 1,
    steps: int = 1,
    layers: int | None = None,
) -> RecordSize:
    """Bytes of the per-token records of REQUESTS requests of TOKENS tokens (module comment):
    rows x tensors x 12 bytes per side, the rollout's on each of its TP ranks."""
    if min(tokens, rollout_tp, train_tp, steps) < 1 or requests < 0:
        raise UserError("tokens, TP and steps must be at least 1 to estimate the record size.")
    rows = requests * tokens

    def side(name: str, ranks: int) -> int:
        per_row = RECORD_FLOAT_BYTES * tensors_per_token(model, name, layers)
        return int(rows * ranks * per_row * RECORD_CALIBRATION)

    return RecordSize(
        requests, tokens, rollout_tp, train_tp, side("rollout", rollout_tp), side("train", train_tp), steps
    )

"""The training side's per-token records (RL_MSPROBE_RECORD_DIR, docs/records.md "Training side").

Part 1 (any machine, main interpreter): the verl-engine helper's layouts on stand-in micro-batches
(packed, padded, Ulysses slices, dynamic groupings are just other micro-batches) and its switches.

Part 2 (e2e, the cached verl CPU test venv): verl 0.9.1 patched by `rl-msprobe patch apply
verl-engine`, its REAL FSDP engine (`forward_backward_batch`, `prepare_model_inputs`,
`forward_step`) over a random 2-layer Qwen2, FSDP2 on a one-rank gloo group
(tests/support/verl_records_scenario.py): the selected requests' record rows equal a forward of
the same model on each request alone; Ulysses SP and Megatron's THD packing against verl's own
slicing / packing code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support import verl_venv
from tests.support.added_files import load
from tests.support.records import load_header
from tests.support.tiers import newest_in_default
from tests.support.trees import patched_release

SCENARIO = Path(__file__).resolve().parents[2] / "support" / "verl_records_scenario.py"
ENGINE_SCENARIO = SCENARIO.with_name("verl_engine_scenario.py")
SWITCHES = (
    "RL_MSPROBE_RECORD_DIR",
    "RL_MSPROBE_RECORD_IDS",
    "RL_MSPROBE_RECORD_SHARE",
    "DUMP_ON",
    "DUMP_POSITIONS",
)


@pytest.fixture
def hooks(monkeypatch, tmp_path):
    """The helper as verl imports it, `verl.utils.rl_msprobe_records` beside it (no verl here)."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    records = load("common/rl_msprobe_records.py", "rl_msprobe_records_under_test")
    verl = types.ModuleType("verl")
    utils = types.ModuleType("verl.utils")
    utils.rl_msprobe_records = records
    verl.utils = utils
    monkeypatch.setitem(sys.modules, "verl", verl)
    monkeypatch.setitem(sys.modules, "verl.utils", utils)
    monkeypatch.setitem(sys.modules, "verl.utils.rl_msprobe_records", records)
    return load("verl/verl/utils/rl_msprobe_hooks.py", "rl_msprobe_hooks_under_test")


def _nested(lengths):
    return torch.nested.as_nested_tensor(
        [torch.arange(n) + 10 * i for i, n in enumerate(lengths)], layout=torch.jagged
    )


class _Batch(dict):
    """A micro-batch as the helper reads it: tensors and a non-tensor `request_id` list."""


def _engine(**attrs):
    return SimpleNamespace(rank=0, engine_config=SimpleNamespace(forward_only=False), module=None, **attrs)


# ---------------------------------------------------------------- part 1: layouts


def test_packed_layout_rows_follow_the_nested_offsets(hooks):
    batch = _Batch(input_ids=_nested([7, 4, 9]))
    layout, meta = hooks.fsdp_layout(_engine(), batch, ["a", "b", "c"])
    assert layout.total == 20
    assert layout.requests == ["a", "b", "c"] and layout.token_rows == [[0, 0, 7], [1, 0, 4], [2, 0, 9]]
    assert layout.token_index == list(range(20))
    assert meta == {"rank": 0, "tp_rank": 0, "tp_size": 1, "phase": "train", "engine": "verl-fsdp"}


def test_only_selected_requests_have_rows(hooks, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "c,a")
    layout, _ = hooks.fsdp_layout(_engine(), _Batch(input_ids=_nested([7, 4, 9])), ["a", "b", "c"])
    assert layout.requests == ["a", "c"] and layout.token_rows == [[0, 0, 7], [1, 0, 9]]
    assert layout.token_index == list(range(7)) + list(range(11, 20))


def test_pad_to_length_rows_at_the_tail_belong_to_no_request(hooks):
    engine = _engine(pad_to_length=True, _get_packed_pad_size=lambda n: 32 - n)
    layout, _ = hooks.fsdp_layout(engine, _Batch(input_ids=_nested([7, 4])), ["a", "b"])
    assert layout.total == 32 and layout.token_index == list(range(11))


def test_padded_layout_without_remove_padding(hooks, monkeypatch):
    batch = _Batch(input_ids=_nested([3, 5, 2]))
    monkeypatch.setattr(
        hooks, "_non_tensor", lambda b, key, default: False if key == "use_remove_padding" else default
    )
    layout, _ = hooks.fsdp_layout(_engine(), batch, ["a", "b", "c"])
    assert layout.total == 15  # [3, max_len 5], right-padded
    assert layout.token_rows == [[0, 0, 3], [1, 0, 5], [2, 0, 2]]
    assert layout.token_index == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]


def test_padded_batch_by_attention_mask_counts_positions_among_valid_rows(hooks):
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])  # left-padded prompt, right-padded response
    batch = _Batch(input_ids=torch.zeros(2, 6, dtype=torch.long), attention_mask=mask)
    layout, _ = hooks.fsdp_layout(_engine(), batch, ["a", "b"])
    assert layout.total == 12 and layout.token_rows == [[0, 0, 3], [1, 0, 6]]
    assert layout.token_index == [2, 3, 4, *range(6, 12)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ulysses_slices_concatenate_to_the_whole_stream(hooks, size):
    """Each SP rank's layout holds its slice's rows with their positions; together, every
    (request, position) exactly once, and pad rows in none."""
    lengths = [7, 4, 9]
    seen = []
    for rank in range(size):
        engine = _engine(
            ulysses_sequence_parallel_size=size,
            ulysses_device_mesh={"sp": SimpleNamespace(get_local_rank=lambda r=rank: r)},
        )
        engine.module = SimpleNamespace(config=SimpleNamespace())
        layout, meta = hooks.fsdp_layout(engine, _Batch(input_ids=_nested(lengths)), ["a", "b", "c"])
        assert layout.total == -(-20 // size) and (meta["sp_rank"], meta["sp_size"]) == (rank, size)
        at = 0
        for request, first, count in layout.token_rows:
            rows = layout.token_index[at : at + count]
            assert all(0 <= r < layout.total for r in rows)
            # the global row of a position: the request's offset plus the position
            offset = sum(lengths[: "abc".index(layout.requests[request])])
            assert [rank * layout.total + r for r in rows] == [
                offset + p for p in range(first, first + count)
            ]
            seen.extend((layout.requests[request], p) for p in range(first, first + count))
            at += count
    assert sorted(seen) == sorted((rid, p) for rid, n in zip("abc", lengths) for p in range(n))


def test_a_vision_model_under_ulysses_is_refused(hooks):
    engine = _engine(
        ulysses_sequence_parallel_size=2,
        ulysses_device_mesh={"sp": SimpleNamespace(get_local_rank=lambda: 0)},
    )
    engine.module = SimpleNamespace(config=SimpleNamespace(vision_config={}))
    with pytest.raises(hooks._records().RlMsprobeRecordError, match="ulysses_sequence_parallel_size=1"):
        hooks.fsdp_layout(engine, _Batch(input_ids=_nested([3])), ["a"])


def test_one_request_id_per_sample_or_a_clear_error(hooks):
    with pytest.raises(hooks._records().RlMsprobeRecordError, match="3 samples but 2 request ids"):
        hooks.fsdp_layout(_engine(), _Batch(input_ids=_nested([3, 4, 5])), ["a", "b"])


def test_which_engine_calls_record(hooks, monkeypatch, tmp_path):
    actor = _engine()
    ref = SimpleNamespace(engine_config=SimpleNamespace(forward_only=True))
    critic = type("FSDPEngineWithValueHead", (), {"engine_config": SimpleNamespace(forward_only=False)})()
    assert not hooks.records_wanted(actor, True), "RL_MSPROBE_RECORD_DIR unset"
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    assert hooks.records_wanted(actor, True)
    assert not hooks.records_wanted(actor, False), "update_actor"
    assert not hooks.records_wanted(ref, True), "the reference model's engine"
    assert not hooks.records_wanted(critic, True), "a value head"


def test_wrappers_leave_the_names(hooks):
    """FSDP1 / checkpoint / Megatron wrappers are not part of a key's name; a Megatron layer is named
    by its global number."""
    from torch import nn

    class FullyShardedDataParallel(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._fsdp_wrapped_module = inner

    layer = nn.Linear(2, 2)
    layer.layer_number = 5
    inner = nn.Module()
    inner.layers = nn.ModuleList([FullyShardedDataParallel(layer)])
    model = FullyShardedDataParallel(nn.Module())
    model._fsdp_wrapped_module.model = inner
    names = [name for name, _ in hooks._Named(model).named_modules()]
    assert names == ["model", "model.layers", "model.layers.4"]


@pytest.fixture
def megatron(monkeypatch):
    """megatron.core.parallel_state as the helper asks it (no megatron here): sizes to set."""
    sizes = {"tp": 1, "pp": 1, "cp": 1}
    state = types.ModuleType("megatron.core.parallel_state")
    state.get_tensor_model_parallel_rank = lambda: 0
    state.get_tensor_model_parallel_world_size = lambda: sizes["tp"]
    state.get_pipeline_model_parallel_rank = lambda: 0
    state.get_pipeline_model_parallel_world_size = lambda: sizes["pp"]
    state.get_context_parallel_world_size = lambda: sizes["cp"]
    core = types.ModuleType("megatron.core")
    core.parallel_state = state
    package = types.ModuleType("megatron")
    package.core = core
    for name, module in (
        ("megatron", package),
        ("megatron.core", core),
        ("megatron.core.parallel_state", state),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return sizes


@pytest.mark.parametrize(
    ("sizes", "config", "sequence_parallel", "needle"),
    [
        ({"tp": 2}, {}, True, "actor.megatron.sequence_parallel=False"),
        ({"cp": 2}, {}, False, "actor.megatron.context_parallel_size=1"),
        ({}, {"dynamic_context_parallel": True}, False, "actor.megatron.context_parallel_size=1"),
        ({}, {"use_remove_padding": False}, False, "actor.megatron.use_remove_padding=True"),
    ],
)
def test_megatron_layouts_not_followed_are_refused_before_the_first_micro_batch(
    hooks, megatron, monkeypatch, tmp_path, sizes, config, sequence_parallel, needle
):
    megatron.update(sizes)
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(forward_only=False, **config),
        tf_config=SimpleNamespace(sequence_parallel=sequence_parallel),
    )
    with pytest.raises(hooks._records().RlMsprobeRecordError, match=needle) as caught:
        hooks.megatron_batch_begin(engine, True)
    assert "--prefill-only" in str(caught.value)
    hooks.megatron_batch_begin(engine, False)  # update_actor records nothing: no refusal
    assert not engine._rl_msprobe_records


def test_megatron_tp_and_pp_without_sequence_parallel_record(hooks, megatron, monkeypatch, tmp_path):
    megatron.update(tp=4, pp=2)
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(forward_only=False), tf_config=SimpleNamespace(sequence_parallel=False)
    )
    hooks.megatron_batch_begin(engine, True)
    assert engine._rl_msprobe_records and engine._rl_msprobe_phase is None  # DUMP_ON unset: no msprobe


# ---------------------------------------------------------------- part 2: the real verl 0.9.1 FSDP engine


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return verl_venv.venv_python_or_skip()


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """version -> a scratch copy of that verl release, patched by `rl-msprobe patch apply verl-engine`."""
    trees: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in trees:
            dest = tmp_path_factory.mktemp("verl") / f"verl-{version}"
            trees[version] = patched_release("verl", version, dest, ["verl-engine"])
        return trees[version]

    return get


@pytest.fixture(scope="module")
def tree(patched) -> Path:
    return patched("0.9.1")


def run_scenario(
    python: Path, tree: Path, workdir: Path, spec: dict, script: Path = SCENARIO, **env: str
) -> dict:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DUMP_", "MSPROBE_", "RL_MSPROBE_", "PROMPTS_ONLY"))
        and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    base.update(PYTHONPATH=str(tree), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", **env)
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(python), str(script), json.dumps({"workdir": str(workdir), **spec})],
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
    return result


def read_records(root: Path) -> list[tuple[dict, np.ndarray]]:
    """Every finished record under ROOT/train/{pid}/, in the order written."""
    out = []
    for header in sorted(root.glob("train/*/rec*.json"), key=lambda p: int(p.stem[3:])):
        doc = load_header(header)
        out.append((doc, np.fromfile(header.with_suffix(".f32"), dtype="<f4")))
    return out


def rows_of(doc: dict, values: np.ndarray, key_prefix: str, label: str) -> dict:
    """{request: {"Max": [...], "Min": [...], "Norm": [...]}} of the tensor at KEY_PREFIX / LABEL."""
    tensor = next(t for t in doc["tensors"] if t["key"].startswith(key_prefix) and t["label"] == label)
    n = sum(count for _, _, count in doc["token_rows"])
    stats = values[tensor["offset"] : tensor["offset"] + 3 * n].reshape(3, n)
    out, at = {}, 0
    for request, first, count in doc["token_rows"]:
        assert first == 0, "a whole request in one FSDP micro-batch"
        out[doc["requests"][request]] = {
            k: stats[i, at : at + count] for i, k in enumerate(("Max", "Min", "Norm"))
        }
        at += count
    return out


FSDP_VERSIONS = ("0.7.1", "0.8.0", "0.9.1")  # the engines' nested micro-batches, the same from 0.7.1
SELECTED = {0, 2, 3, 5}  # samples recorded (RL_MSPROBE_RECORD_IDS); 1 and 4 are not
CALLS = [
    ("packed", {"role": "actor", "forward_only": True, "remove_padding": True}),
    ("padded", {"role": "actor", "forward_only": True, "remove_padding": False}),
    ("dynamic", {"role": "actor", "forward_only": True, "remove_padding": True, "dynamic": True}),
    ("ref", {"role": "ref", "forward_only": True}),
    ("update", {"role": "actor", "forward_only": False}),
    ("off", {"role": "actor", "forward_only": True}),
]


@pytest.mark.e2e
@pytest.mark.parametrize("version", newest_in_default(FSDP_VERSIONS))
def test_real_fsdp_engine_records_equal_each_request_alone(venv_python, patched, tmp_path, version):
    """Packed, padded and dynamic-batch log-prob forwards of the real engine: each selected request's
    rows equal a forward of the same model on that request alone (layer 0's down_proj output and
    the lm_head logits, per-row Max / Min / norm, fp32 rel 1e-4; verl 0.7.1 always autocasts to
    bf16, compared at bf16's precision), its token ids and positions are its
    prompt + response at 0..P+R-1, unselected requests have no rows; the ref engine, update_actor and
    a forward with RL_MSPROBE_RECORD_DIR unset write nothing; msprobe is never imported (DUMP_ON unset)."""
    calls = []
    for index, (name, call) in enumerate(CALLS):
        ids = ",".join(f"req-{index}-{i}" for i in sorted(SELECTED))
        folder = None if name == "off" else str(tmp_path / "records" / name)
        calls.append({**call, "env": {"RL_MSPROBE_RECORD_DIR": folder, "RL_MSPROBE_RECORD_IDS": ids}})
    result = run_scenario(
        venv_python, patched(version), tmp_path / "work", {"calls": calls, "reference": True}
    )
    assert not result["msprobe_imported"]
    # fp32 (verl 0.8.0+ honours the parameters' dtype); 0.7.1 always autocasts to bf16, the reference too
    tolerance = {"rtol": 3e-2, "atol": 1e-3} if result["bf16_autocast"] else {"rtol": 1e-4, "atol": 1e-6}
    assert result["bf16_autocast"] is (version == "0.7.1")
    written = {p.name for p in (tmp_path / "records").iterdir()}
    assert written == {"packed", "padded", "dynamic"}, "ref, update_actor and records off write nothing"
    assert not list((tmp_path / "work").rglob("rec*.json"))

    for index, (name, _) in enumerate(CALLS[:3]):
        call = result["calls"][index]
        assert call["error"] is None, call["error"]["traceback"]
        records = read_records(tmp_path / "records" / name)
        micro = call["micro_batches"]
        if name == "dynamic":
            assert [len(m) for m in micro] != [3, 3], "the token budget regroups the samples"
        # one record per micro-batch holding a selected request, its requests in micro-batch order
        expected = [[rid for rid in m if int(rid.rsplit("-", 1)[1]) in SELECTED] for m in micro]
        assert [doc["requests"] for doc, _ in records] == [e for e in expected if e], name
        samples = {s["id"]: s for s in call["samples"]}
        for doc, values in records:
            assert doc["side"] == "train" and doc["phase"] == "train" and doc["engine"] == "verl-fsdp"
            assert (doc["rank"], doc["tp_rank"], doc["tp_size"]) == (0, 0, 1) and "sp_size" not in doc
            for rid, (_, first, count) in zip(doc["requests"], doc["token_rows"]):
                s = samples[rid]
                assert (first, count) == (0, len(s["prompt"]) + len(s["response"])), (name, rid)
            tokens = rows_of(doc, values, "Module.model.embed_tokens.", "input.0")
            positions = rows_of(doc, values, "Module.model.rotary_emb.", "input.1")
            for rid, stats in tokens.items():
                ids = samples[rid]["prompt"] + samples[rid]["response"]
                assert stats["Max"].tolist() == ids and stats["Min"].tolist() == ids, (name, rid)
                assert positions[rid]["Max"].tolist() == list(range(len(ids))), (name, rid)
            for module, key in (
                ("down", "Module.model.layers.0.mlp.down_proj.Linear."),
                ("lm_head", "Module.lm_head."),
            ):
                got = rows_of(doc, values, key, "output.0")
                for rid, stats in got.items():
                    ref = call["reference"][rid][module]
                    for stat in ("Max", "Min", "Norm"):
                        np.testing.assert_allclose(
                            stats[stat],
                            ref[stat],
                            **tolerance,
                            err_msg=f"{name} {rid} {module} {stat}",
                        )


@pytest.mark.e2e
def test_ulysses_and_megatron_layouts_against_verl_own_slicing(venv_python, tree, tmp_path):
    """Ulysses SP (2, 3 ranks): verl's own prepare_model_inputs slices the packed stream; at the
    rows each rank's layout names, its inputs hold the request's tokens and position ids. Megatron
    (TP 1, 2, 4): verl's own preprocess_thd_engine aligns each sample to the TP size; the helper's
    Megatron recorder, on a chunk called as verl calls it, records each request's tokens at 0..len-1,
    with tp_rank / tp_size / pp_rank in the header and the layer under its global number."""
    result = run_scenario(
        venv_python,
        tree,
        tmp_path / "work",
        {"sp_layout": [2, 3], "megatron_layout": [1, 2, 4]},
        RL_MSPROBE_RECORD_DIR=str(tmp_path / "records"),
    )
    samples = {}
    for i, (p, r) in enumerate(zip((3, 5, 2, 4, 6, 3), (4, 2, 5, 3, 1, 6))):
        samples[f"req-0-{i}"] = p + r
    for size in (2, 3):
        parts = [x for x in result["sp_layout"] if x["size"] == size]
        seen = set()
        for part in parts:
            assert part["rows_in_input"] == part["total"], "the layout's rows are the rank's input rows"
            assert part["meta"]["sp_size"] == size and part["meta"]["sp_rank"] == part["rank"]
            positions = list(range(part["first"], part["first"] + len(part["tokens"])))
            assert part["positions"] == positions, part
            seen.update((part["request"], p) for p in positions)
        assert seen == {(rid, p) for rid, n in samples.items() for p in range(n)}, size
    # each request's tokens, its pieces on the SP ranks put together by position
    tokens: dict = {}
    for part in sorted((x for x in result["sp_layout"] if x["size"] == 2), key=lambda x: x["first"]):
        tokens.setdefault(part["request"], []).extend(part["tokens"])
    assert {rid: len(t) for rid, t in tokens.items()} == samples

    packed = []
    for tp, entry in zip((1, 2, 4), result["megatron_layout"]):
        header = entry["header"]
        assert (header["tp_rank"], header["tp_size"], header["pp_rank"], header["pp_size"]) == (
            tp - 1,
            tp,
            1,
            2,
        )
        assert header["engine"] == "verl-megatron" and header["phase"] == "train"
        assert header["token_rows"] == [[i, 0, samples[rid]] for i, rid in enumerate(header["requests"])]
        assert entry["keys"] == ["Module.embedding.Embedding.forward.0", "Module.layers.2.Linear.forward.0"]
        packed.append(entry["packed_rows"])
        expected = [t for rid in header["requests"] for t in tokens[rid]]
        assert entry["tokens"] == expected, "each request's tokens at 0..len-1, whatever the alignment"
    assert packed[0] == sum(samples.values()) and packed[1] > packed[0] and packed[2] > packed[1]


@pytest.mark.e2e
def test_real_megatron_engine_records_its_log_prob_micro_batches(venv_python, tree, tmp_path):
    """The real MegatronEngine.forward_backward_batch (megatron-core's no-pipelining schedule, verl's
    THD packing and log-prob head, a stand-in model: tests/support/verl_engine_scenario.py): one
    record per log-prob micro-batch, each request's tokens at 0..len-1; the ref engine and
    update_actor write nothing; msprobe is not imported."""
    folder = tmp_path / "records"
    calls = [
        {"role": "ref", "forward_only": True},
        {"role": "actor", "forward_only": True},
        {"role": "actor", "forward_only": False},
    ]
    result = run_scenario(
        venv_python,
        tree,
        tmp_path / "work",
        {"engine": "megatron", "calls": calls},
        script=ENGINE_SCENARIO,
        RL_MSPROBE_RECORD_DIR=str(folder),
    )
    assert all(call["error"] is None for call in result["calls"]), result["calls"]
    assert not result["msprobe_imported"]
    records = read_records(folder)
    micro = result["calls"][1]["micro_batch_ids"]
    assert [doc["requests"] for doc, _ in records] == [["req-1-0", "req-1-1"], ["req-1-2", "req-1-3"]]
    for (doc, values), tokens in zip(records, micro):
        assert (doc["engine"], doc["tp_rank"], doc["tp_size"], doc["pp_rank"], doc["pp_size"]) == (
            "verl-megatron",
            0,
            1,
            0,
            1,
        )
        ids = rows_of(doc, values, "Module.embed.", "input.0")
        assert [t for rid in doc["requests"] for t in ids[rid]["Max"].tolist()] == tokens
        assert [c for _, _, c in doc["token_rows"]] == [6, 5]  # the scenario's lengths, SEQ - i % 2

"""The job-side helper's contract: off, it imports and computes nothing; on, a failure costs
fingerprints, never the sync; the resident side splits fused parameters and drops padding."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.weights.helper import PATH, load, vllm_worker

OFF = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("w", {str(PATH)!r})
w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
stream = iter([("a", object())])
assert w.sent(stream, 3) is stream
assert w.received(object(), [("a", object())]) is None
assert w.engine_sync(lambda self: 7)(object()) == 7
print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
"""


def test_off_means_nothing_imported_or_computed():
    env = {"PATH": "/usr/bin:/bin"}  # no RL_MSPROBE_WEIGHTS_DIR
    out = subprocess.run([sys.executable, "-c", OFF], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_a_failure_costs_fingerprints_not_the_sync(tmp_path, monkeypatch, capsys):
    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    weights = [("good", torch.ones(3)), ("bad", "not a tensor"), ("also_good", torch.zeros(2))]
    assert list(helper.sent(iter(weights), 5)) == weights  # every item still goes through
    lines = [json.loads(x) for p in tmp_path.glob("sent-*.jsonl") for x in p.read_text().splitlines()]
    assert [x["name"] for x in lines] == ["good", "also_good"] and lines[0]["step"] == 5
    assert "the sent fingerprint failed" in capsys.readouterr().err


class _Fused(torch.nn.Module):
    """A fused column-parallel layer as vLLM holds it on one TP rank, and a padded vocab shard."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(24.0).reshape(6, 4), requires_grad=False)
        self.output_partition_sizes = [2, 1, 3]


class _Vocab(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, 4), requires_grad=False)
        self.shard_indices = type("Indices", (), {"num_org_elements": 5})()


class _Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _Fused()
        self.embed = _Vocab()


def test_resident_parts_split_fused_and_drop_padding():
    helper = load()
    model = _Model()
    fused = dict(
        helper._parts(model, "attn.qkv_proj", model.attn.qkv_proj, "weight", model.attn.qkv_proj.weight)
    )
    assert list(fused) == ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"]
    assert [t.shape[0] for t in fused.values()] == [2, 1, 3]
    assert torch.equal(torch.cat(list(fused.values())), model.attn.qkv_proj.weight)
    ((name, rows),) = helper._parts(model, "embed", model.embed, "weight", model.embed.weight)
    assert name == "embed.weight" and rows.shape == (5, 4)


def test_the_device_path_gives_the_numpy_path_s_numbers():
    """GPU / NPU tensors are fingerprinted where they live (torch, float64 blocks); run here on the
    CPU through the same function: the numbers must agree with the numpy path's."""
    from rl_msprobe.weights.fingerprint import Fingerprint, compare

    helper = load()
    g = torch.Generator().manual_seed(7)
    for t in (torch.randn(3000, 7, generator=g), torch.randn(5000, generator=g).to(torch.bfloat16)):
        bad = t.clone()
        bad[3] = float("nan")
        bad[11] = float("-inf")
        for x in (t, bad):
            numpy_fp = Fingerprint.from_dict(helper.fingerprint(x))
            total, sumsq, low, high, nan, inf = helper._device_stats(x)
            device_fp = Fingerprint(x.numel(), total, sumsq, low, high, nan, inf)
            assert compare(numpy_fp, device_fp).equal, (numpy_fp, device_fp)
            assert (device_fp.nan, device_fp.inf) == (numpy_fp.nan, numpy_fp.inf)


def k64_of_whole_bytes(helper, t: torch.Tensor) -> str:
    """The k64 definition over the tensor's whole row-major bytes at once (no pieces, no carries):
    zero-padded little-endian words, folded, times KEYS[j % WORDS] * block key(j // WORDS), summed
    modulo 2**64, header added, splitmix64-finished."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(data + b"\0" * (-len(data) % 8), dtype="<u8")
    j = np.arange(words.size)
    keys = helper._word_keys()[j % helper.WORDS]
    blocks = np.array([helper._mix(int(b) + (1 << 40)) | 1 for b in j // helper.WORDS], dtype=np.uint64)
    total = int(np.add.reduce((words ^ (words >> np.uint64(32))) * keys * blocks)) if words.size else 0
    header = int.from_bytes(
        hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}|".encode(), digest_size=8).digest(), "little"
    )
    return f"k64:{helper._mix((total + header) % 2**64):016x}"


def test_one_pass_is_the_whole_tensor_definition(monkeypatch):
    """Statistics and the k64 checksum from one pass over cache-sized blocks are what the
    definitions give over the whole tensor (the checksum of its contiguous bytes, float64 sums,
    exact min / max, NaN / Inf counts), for views that are not contiguous, dtypes numpy lacks and
    byte counts that are no multiple of 8, with blocks and key blocks small enough to split each
    (strided pieces of odd byte counts then start mid-word)."""
    helper = load()
    monkeypatch.setattr(helper, "BLOCK", 1000)
    monkeypatch.setattr(helper, "WORDS", 512)
    base = torch.randn(300, 71, generator=torch.Generator().manual_seed(3))
    base[17, 3], base[250, 9], base[299, 70] = math.nan, math.inf, -math.inf
    views = (base, base.t(), base[:, 5:60], base.bfloat16(), base.half().t(), base.double()[::2],
             base.half()[:, :3], base.to(torch.float8_e4m3fn)[:, 1:8])  # fmt: skip
    for t in views:
        fp, checksum = helper._measure(t, True)
        assert checksum == k64_of_whole_bytes(helper, t) == helper.digest(t), t.dtype
        if t.dtype == torch.float8_e4m3fn:
            continue  # its NaN / range rules are fp8's; the statistics below are checked on the others
        flat = t.contiguous().reshape(-1)
        x = flat.double().numpy()
        finite = x[np.isfinite(x)]
        assert (fp["count"], fp["nan"], fp["inf"]) == (x.size, np.isnan(x).sum(), np.isinf(x).sum())
        assert (fp["min"], fp["max"]) == (finite.min(), finite.max())
        assert math.isclose(fp["sum"], math.fsum(finite), rel_tol=1e-12, abs_tol=1e-9)
        assert math.isclose(fp["sumsq"], math.fsum(finite * finite), rel_tol=1e-12)


class _StackedModel(torch.nn.Module):
    """A model that says its fused parts the way SGLang's Qwen2 does (no packed_modules_mapping)."""

    bitsandbytes_stacked_params_mapping = {
        "v_proj": ("qkv_proj", 2),
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
    }

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _Fused()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.scale: dict[str, float] = {}  # test-only: a fault inside the load

    def load_weights(self, named):
        offsets = {"q_proj": (0, 2), "k_proj": (2, 1), "v_proj": (3, 3)}
        for name, tensor in named:
            if name == "norm.weight":
                self.norm.weight.data.copy_(tensor)
                continue
            start, size = offsets[name.split(".")[1]]
            self.attn.qkv_proj.weight.data[start : start + size] = tensor * self.scale.get(name, 1.0)


def _runner(helper, model):
    """An SGLang-shaped engine (the lines sglang-weights puts in): one update call per bucket."""

    class Runner:
        def __init__(self):
            self.model = model

        @helper.engine_call
        def update_weights_from_tensor(self, named):
            helper.call_received(self, named)
            self.model.load_weights(named)

    return Runner()


def test_a_bucketed_engine_fingerprints_each_call_and_counts_syncs(tmp_path, monkeypatch):
    """Per call: received as it arrives, resident of what it loaded (fused parts split by the stacked
    mapping); a name seen again starts the next sync; the meta lists every name the model holds."""
    from rl_msprobe.weights.compare import compare_run
    from rl_msprobe.weights.records import read_run

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    model = _StackedModel()
    runner = _runner(helper, model)
    g = torch.Generator().manual_seed(11)
    tensors = {
        "attn.q_proj.weight": torch.randn(2, 4, generator=g),
        "attn.k_proj.weight": torch.randn(1, 4, generator=g),
        "attn.v_proj.weight": torch.randn(3, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g),
    }
    names = list(tensors)
    for sync, scale in ((1, {}), (2, {"attn.k_proj.weight": 1.001})):
        model.scale = scale  # a fault inside the load at sync 2
        sent = list(helper.sent(iter(tensors.items()), sync))
        for bucket in (sent[:1], sent[1:3], sent[3:]):  # q | k, v | norm: the fused layer spans two calls
            runner.update_weights_from_tensor(bucket)
    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT"], doc["steps"]
    assert [s["resident_reused"] for s in doc["steps"]] == [4, 3]  # all but the faulty part: same bytes
    assert all(s["sent_tensors"] == s["model_tensors"] == len(names) for s in doc["steps"]), doc["steps"]
    fd = doc["first_difference"]
    assert (fd["sync"], fd["name"], fd["stage"]) == (2, "attn.k_proj.weight", "resident"), fd
    meta = [json.loads(x) for p in tmp_path.glob("resident-*.jsonl") for x in p.read_text().splitlines()]
    holds = {tuple(m["holds"]) for m in meta if m["stage"] == "resident-meta"}
    assert holds == {("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "norm.weight")}


def test_a_held_tensor_never_sent_is_never_equal(tmp_path, monkeypatch):
    from rl_msprobe.weights.compare import compare_run
    from rl_msprobe.weights.records import read_run

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    runner = _runner(helper, _StackedModel())
    partial = [("norm.weight", torch.full((4,), 2.0))]
    runner.update_weights_from_tensor(list(helper.sent(iter(partial), 1)))
    doc = compare_run(read_run(tmp_path))
    assert doc["verdict"] == "NOT COMPARED", doc["steps"]
    missing = {r["name"] for r in doc["tensors"] if r["resident"]["status"] == "missing"}
    assert missing == {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"}, doc["tensors"]


def test_a_tp_rank_s_own_rows_come_from_the_pass_over_the_whole_tensor(tmp_path, monkeypatch):
    """With TP > 1 a received tensor's dim-0 chunk (this rank's rows) is measured in the same pass
    as the whole tensor: its numbers are exactly those of the chunk on its own, the whole tensor's
    checksum is unchanged and its sums agree within float64 accumulation; strided tensors and rows
    that do not split evenly are measured on their own, as before."""
    from rl_msprobe.weights.fingerprint import Fingerprint, compare

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    monkeypatch.setattr(helper, "BLOCK", 1000)  # the chunk edges fall inside blocks
    gen = torch.Generator().manual_seed(11)
    weights = [
        ("rows", torch.randn(300, 70, generator=gen)),
        ("strided", torch.randn(70, 300, generator=gen).t()),
        ("uneven", torch.randn(301, 8, generator=gen)),
        ("vector", torch.randn(4000, generator=gen).bfloat16()),
    ]
    for tp, rank in ((2, 1), (4, 2)):
        state = {"sync": tp, "rank": rank, "tp_size": tp, "index": 0}
        helper._received(state, weights)
        lines = [json.loads(x) for x in next(tmp_path.glob("received-*")).read_text().splitlines()]
        got = {line["name"]: line for line in lines if line["sync"] == tp}
        for name, t in weights:
            line = got[name]
            whole = Fingerprint.from_dict(helper.fingerprint(t))
            assert line["hash"] == helper.digest(t)
            assert compare(whole, Fingerprint.from_dict(line["fp"])).equal
            for dim in (0, 1)[: t.dim()]:
                if t.shape[dim] % tp:
                    assert str(dim) not in line["shard_fp"]
                    continue
                assert line["shard_fp"][str(dim)] == helper.fingerprint(t.chunk(tp, dim)[rank]), (name, dim)


class _Plain(torch.nn.Module):
    """A model whose loader copies each tensor it knows into its parameter (vLLM's default loader)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.head = torch.nn.Module()
        self.head.weight = torch.nn.Parameter(torch.ones(3, 4), requires_grad=False)
        self.skip: set[str] = set()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        with torch.inference_mode():
            for name, tensor in weights:
                if name not in self.skip:  # a loader that misses a name
                    params[name].data.copy_(tensor)

    def forward(self, x):
        return self.head.weight @ (x * self.norm.weight)


def test_reset_mode_names_the_parameter_the_loader_never_wrote(tmp_path, monkeypatch):
    """RL_MSPROBE_WEIGHTS_RESET=2: before sync 2 every parameter is filled with the pattern; the one the
    loader skipped still holds it afterwards (reset_kept), and the compare names it NOT SYNCED.
    Sync 1 (no reset) reads EQUAL although the same loader misses the same name: the gap reset mode
    closes when the load-time value happens to be the sent one."""
    from rl_msprobe.weights.compare import compare_run
    from rl_msprobe.weights.records import read_run

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    monkeypatch.setenv(helper.RESET_ENV, "2")
    with torch.inference_mode():  # as vLLM makes its parameters: inference tensors
        model = _Plain()
    model.skip = {"norm.weight"}
    worker = vllm_worker(helper, model)
    tensors = [("norm.weight", torch.ones(4)), ("head.weight", torch.full((3, 4), 0.5))]
    for sync in (1, 2):
        worker.update_weights_from_ipc(list(helper.sent(iter(tensors), sync)))
    lines = [json.loads(x) for p in tmp_path.glob("resident-*.jsonl") for x in p.read_text().splitlines()]
    kept = {(x["sync"], x["name"]): x.get("reset_kept") for x in lines if x["stage"] == "resident"}
    assert kept == {(1, "norm.weight"): None, (1, "head.weight"): None} | {
        (2, "norm.weight"): True,
        (2, "head.weight"): False,
    }
    assert bool((model.norm.weight == helper.PATTERN).all())  # what the engine serves after sync 2
    doc = compare_run(read_run(tmp_path))
    assert [s["verdict"] for s in doc["steps"]] == ["EQUAL", "DIFFERENT"], doc["steps"]
    assert [(x["sync"], x["name"], x["shape"], x["ranks"]) for x in doc["not_synced"]] == [
        (2, "norm.weight", [4], [0])
    ]


class _LayerwiseReload(torch.nn.Module):
    """The shape of vLLM's layer-by-layer reload (model_loader.reload), which the live tp2 job runs for
    real (tests/live/test_consistency_job.py's NOT SYNCED sync): at the sync's start each layer's
    parameters go on meta and the real ones are kept aside in LAYERWISE_INFO[layer].kernel_tensors;
    a layer given its tensor gets it copied into what was kept and put back; after the sync returns,
    every layer not loaded gets its kept parameters back as they were. vLLM cannot be imported here:
    its bookkeeping is stood in for by a module under its name."""

    def __init__(self, infos):
        super().__init__()
        self.norm = _Plain().norm
        self.head = _Plain().head
        self.skip: set[str] = set()
        self.infos = infos

    def begin(self):
        for layer in (self.norm, self.head):
            kept = {"weight": layer.weight}
            self.infos[layer] = type("Info", (), {"kernel_tensors": (kept, {})})()
            layer.weight = torch.nn.Parameter(
                torch.empty_like(kept["weight"], device="meta"), requires_grad=False
            )

    def load_weights(self, weights):
        with torch.inference_mode():
            for name, tensor in weights:
                layer = getattr(self, name.split(".")[0])
                if name not in self.skip:  # a layer loaded whole is put back at once
                    self.infos[layer].kernel_tensors[0]["weight"].data.copy_(tensor)
                    layer.weight = self.infos.pop(layer).kernel_tensors[0]["weight"]

    def finish(self):
        for layer in list(self.infos):
            layer.weight = self.infos.pop(layer).kernel_tensors[0]["weight"]

    def forward(self, x):
        return self.head.weight @ (x * self.norm.weight)


@pytest.mark.parametrize("engine", ["plain", "layerwise"])
def test_reset_mode_checks_at_the_first_forward_after_the_sync(engine, tmp_path, monkeypatch):
    """The reset sync is the job's last: the check runs at the rollout's first forward after it, not
    at a next sync that never comes, and not at the sync's end, before a layer-by-layer reload puts
    back what it was not given. With that reload the fill reaches the parameters kept aside while a
    layer is on meta, so the skipped layer is put back holding the pattern and named."""
    import types
    import weakref

    from rl_msprobe.weights.compare import compare_run
    from rl_msprobe.weights.records import read_run

    helper = load()
    monkeypatch.setenv(helper.ENV, str(tmp_path))
    monkeypatch.setenv(helper.RESET_ENV, "1")
    infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    layerwise = types.ModuleType("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.LAYERWISE_INFO = infos
    monkeypatch.setitem(sys.modules, layerwise.__name__, layerwise)
    with torch.inference_mode():
        model = _Plain() if engine == "plain" else _LayerwiseReload(infos)
    model.skip = {"norm.weight"}
    worker = vllm_worker(helper, model)
    tensors = [("norm.weight", torch.full((4,), 2.0)), ("head.weight", torch.full((3, 4), 0.5))]
    if engine == "layerwise":
        model.begin()
    worker.update_weights_from_ipc(list(helper.sent(iter(tensors), 1)))
    if engine == "layerwise":
        model.finish()

    def kept() -> list:
        lines = [json.loads(x) for p in tmp_path.glob("resident-*.jsonl") for x in p.read_text().splitlines()]
        return [x["reset_kept"] for x in lines if "reset_kept" in x and x["stage"] == "resident-meta"]

    assert kept() == []  # not yet: the engine may still put back what it was not given
    with torch.inference_mode():
        model(torch.ones(4))
        model(torch.ones(4))  # the check runs once
    assert kept() == [["norm.weight"]]
    assert bool((model.norm.weight == helper.PATTERN).all()) and bool((model.head.weight == 0.5).all())
    doc = compare_run(read_run(tmp_path))
    assert [(x["sync"], x["name"], x["ranks"]) for x in doc["not_synced"]] == [(1, "norm.weight", [0])]
    assert "still holds the reset pattern" in doc["not_synced"][0]["why"]

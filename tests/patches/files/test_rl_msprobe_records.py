"""The shared per-token recorder (rl_msprobe/patches/files/common/rl_msprobe_records.py) on a real
torch model: the selected requests' rows of a batched forward, their Max / Min / norm as the rows
themselves give them, the header of docs/records.md, and the selection the same for every side."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.records import load_header

torch = pytest.importorskip("torch")

HELPER = Path(__file__).resolve().parents[3] / "rl_msprobe/patches/files/common/rl_msprobe_records.py"


def helper():
    spec = importlib.util.spec_from_file_location("rl_msprobe_records_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 50)

    def forward(self, ids, sample_rows=None):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h if sample_rows is None else h[sample_rows])


def read(header_path: str):
    header = load_header(Path(header_path))
    raw = Path(header_path[: -len(".json")] + ".f32").read_bytes()
    import array

    values = array.array("f")
    values.frombytes(raw)
    return header, values


def leaf(header, values, key_part, label):
    t = next(t for t in header["tensors"] if key_part in t["key"] and t["label"] == label)
    n = sum(c for _, _, c in header["token_rows"]) if t["rows"] == "token" else len(header["sample_rows"])
    o = t["offset"]
    return t, values[o : o + n], values[o + n : o + 2 * n], values[o + 2 * n : o + 3 * n]


def test_records_the_selected_rows_of_a_packed_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "b")
    rec = helper()
    torch.manual_seed(0)
    model = Block()
    # a packed forward of three requests: a (rows 0..2, positions 0..2), b (rows 3..6, positions 5..8), c
    ids = torch.randint(0, 50, (10,))
    segments = [
        (rid, row, pos, n) for rid, row, pos, n in (("a", 0, 0, 3), ("b-0123abcd", 3, 5, 4), ("c", 7, 0, 3))
    ]
    layout = rec.Layout(10, [s for s in segments if rec.selected(s[0])])
    recorder = rec.Recorder(
        model, layout, "rollout", {"rank": 0, "tp_rank": 0, "tp_size": 1, "phase": "mixed"}
    )
    with torch.no_grad():
        out = model(ids)
    path = recorder.finish()
    header, values = read(path)
    assert header["format"] == "rl-msprobe-records/1" and header["requests"] == ["b"]
    assert header["token_rows"] == [[0, 5, 4]]
    t, hi, lo, norm = leaf(header, values, "head", "output.0")
    rows = out[3:7]
    assert t["width"] == 50 and t["dtype"] == "torch.float32"
    assert list(hi) == pytest.approx(rows.amax(1).tolist())
    assert list(lo) == pytest.approx(rows.amin(1).tolist())
    assert list(norm) == pytest.approx(rows.norm(dim=1).tolist(), rel=1e-6)
    _, ids_hi, ids_lo, _ = leaf(header, values, "embed", "input.0")
    assert list(ids_hi) == list(ids_lo) == [float(v) for v in ids[3:7]]  # the token ids
    assert not model.head._forward_hooks  # hooks removed
    assert Path(path).with_suffix(".f32").stat().st_size == 4 * sum(3 * 4 for _ in header["tensors"])
    # the tensor table is written once per process and table, the header names it
    assert json.loads(Path(path).read_text())["schema"] == 0 and "tensors" not in json.loads(
        Path(path).read_text()
    )


def test_sample_rows_and_filters(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("RL_MSPROBE_RECORD_LAYERS", "1")
    rec = helper()
    model = Block()
    ids = torch.randint(0, 50, (6,))
    # two requests of 3 rows each; the head sees only each request's last row (vLLM's logits)
    layout = rec.Layout(6, [("x", 0, 0, 3), ("y", 3, 7, 3)], [("x", 0, 2), ("y", 1, 9)], num_samples=2)
    recorder = rec.Recorder(model, layout, "rollout")
    with torch.no_grad():
        model(ids, sample_rows=torch.tensor([2, 5]))
    header, values = read(recorder.finish())
    keys = {t["key"] for t in header["tensors"]}
    assert not any("layers.0." in k for k in keys) and any("layers.1." in k for k in keys)
    t, hi, _, _ = leaf(header, values, "head", "output.0")
    assert t["rows"] == "sample" and header["sample_rows"] == [[0, 2], [1, 9]] and len(hi) == 2
    second = rec.Recorder(model, layout, "rollout")
    with torch.no_grad():
        model(ids, sample_rows=torch.tensor([2, 5]))
    assert second.finish().endswith("rec1.json")


@pytest.mark.parametrize(
    "ids_env, rows", [("a,b", slice(0, 7)), ("b", slice(3, 7)), ("a,c", [0, 1, 2, 7, 8, 9])]
)
def test_bf16_stats_equal_a_float64_reference_and_a_contiguous_selection_is_a_view(
    tmp_path, monkeypatch, ids_env, rows
):
    """A bf16 model's rows: Max / Min exactly the float64 ones (bf16 values are exact in float32),
    the norm within bf16 rounding. One contiguous range of selected rows is a view of the tensor
    (`index_select` never called, the rows share its storage); scattered rows are gathered."""
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", ids_env)
    rec = helper()
    torch.manual_seed(1)
    model = Block().to(torch.bfloat16)
    seen: dict = {}
    model.layers[1].register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    segments = [("a", 0, 0, 3), ("b", 3, 0, 4), ("c", 7, 0, 3)]
    layout = rec.Layout(10, [s for s in segments if rec.selected(s[0])])
    recorder = rec.Recorder(model, layout, "rollout")
    contiguous = isinstance(rows, slice)
    calls = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: calls.append(1) or real(self, *a))
    with torch.no_grad():
        model(torch.randint(0, 50, (10,)))
    assert bool(calls) is not contiguous
    header, values = read(recorder.finish())
    t, hi, lo, norm = leaf(header, values, "layers.1", "output.0")
    assert t["dtype"] == "torch.bfloat16" and t["width"] == 8
    reference = seen["out"].double()[rows]
    assert list(hi) == reference.amax(1).tolist() and list(lo) == reference.amin(1).tolist()
    assert list(norm) == pytest.approx(reference.norm(dim=1).tolist(), rel=2**-8)
    view = recorder._rows(seen["out"], "token")
    assert view.shape == (len(reference), 8)
    shares = view.untyped_storage().data_ptr() == seen["out"].untyped_storage().data_ptr()
    assert shares is contiguous
    # an accelerator's one fused aminmax gives the CPU's two reductions, value for value
    for fused, cpu in zip(rec._stats(view, fused=True), rec._stats(view, fused=False), strict=True):
        assert fused.dtype == cpu.dtype and torch.equal(fused, cpu)


def test_gather_keeps_each_tensors_order_across_dtypes():
    """An accelerator's bf16 model keeps Max / Min in bf16 and the norm in float32 until the record
    is written: the values come back per tensor, Max then Min then norm, whatever the grouping."""
    rec = helper()
    a = (torch.tensor([1.5, 2.0], dtype=torch.bfloat16), torch.tensor([-1.0, 0.5], dtype=torch.bfloat16))
    b = (torch.tensor([7.0]), torch.tensor([3.0]), torch.tensor([9.0], dtype=torch.float64))
    values = [(*a, torch.tensor([4.0, 5.0])), b, (*a, torch.tensor([6.0, 8.0]))]
    assert rec._gather(values).tolist() == [1.5, 2.0, -1.0, 0.5, 4.0, 5.0, 7.0, 3.0, 9.0] + [
        1.5,
        2.0,
        -1.0,
        0.5,
        6.0,
        8.0,
    ]


def test_selection_is_by_base_id_and_share(monkeypatch):
    rec = helper()
    ids = [f"req{i}" for i in range(2000)]
    monkeypatch.setenv("RL_MSPROBE_RECORD_SHARE", "0.1")
    chosen = [i for i in ids if rec.selected(i)]
    assert 120 < len(chosen) < 280
    assert all(rec.selected(i + "-deadbeef") for i in chosen)  # vLLM's suffix does not change the choice
    monkeypatch.setenv("RL_MSPROBE_RECORD_SHARE", "2")
    with pytest.raises(rec.RlMsprobeRecordError, match="RL_MSPROBE_RECORD_SHARE"):
        rec.selected("x")
    monkeypatch.setenv("RL_MSPROBE_RECORD_IDS", "a,b_P")
    assert rec.selected("a-0011aabb") and rec.selected("b") and not rec.selected("c")
    assert rec.base_id("abc-0123abcd") == "abc" and rec.base_id("abc-0123") == "abc-0123"


def test_base_id_is_the_correlate_rule():
    from rl_msprobe.dumps.correlate import strip_request_id

    rec = helper()
    for rid in ("abc", "abc-0123abcd", "x-0123abcd_P", "abc_P", "-0123abcd", "a-0123ABCD"):
        assert rec.base_id(rid) == strip_request_id(rid)


class Shared(torch.nn.Module):
    """One tensor into two projections (as q and k share their input), then changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.bump = Bump()

    def forward(self, x):
        a, b = self.q(x), self.k(x)
        self.bump(x)  # x * 2 in place: its next reader must see the new values
        return a + b + self.q(x)


class Bump(torch.nn.Module):
    def forward(self, x):
        return x.mul_(2)


def test_each_module_s_values_are_those_it_saw_also_under_inference_mode(tmp_path, monkeypatch):
    """vLLM and SGLang run under torch.inference_mode; a tensor several modules read and one changed
    in place between them (a fused residual add does that) are recorded as each module saw them."""
    monkeypatch.setenv("RL_MSPROBE_RECORD_DIR", str(tmp_path))
    rec = helper()
    model = Shared()
    recorder = rec.Recorder(model, rec.Layout(5, [("r", 0, 0, 5)]), "rollout")
    with torch.inference_mode():
        x = torch.randn(5, 8)
        before = x.clone()
        model(x)
    header, values = read(recorder.finish())
    _, hi, _, _ = leaf(header, values, "k.Linear.forward.0", "input.0")
    assert list(hi) == pytest.approx(before.amax(1).tolist())
    _, hi, _, _ = leaf(header, values, "q.Linear.forward.1", "input.0")
    assert list(hi) == pytest.approx((2 * before).amax(1).tolist())

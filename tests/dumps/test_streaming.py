"""Token counts that are not counts, and the streaming readers behind long lines and huge dumps.

The readers are run with a read size of a few dozen bytes, so the small lines here cross every
boundary a 50 MB line crosses (a value, a key, a comma, an escape or a UTF-8 character cut
between two reads)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_msprobe.dumps import correlate as correlate_module
from rl_msprobe.dumps import jsonl
from rl_msprobe.dumps.correlate import correlate, strip_request_id
from rl_msprobe.dumps.layout import check_dump_file
from rl_msprobe.errors import UserError
from tests.dumps.conftest import dispatch, update, write_dump, write_jsonl
from tests.support.trees import run_cli


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl, "CHUNK", 64)
    monkeypatch.setattr(jsonl, "READ", 64)
    monkeypatch.setattr(jsonl, "MARGIN", 8)
    monkeypatch.setattr(jsonl, "BATCH", 40)


def _read(data: bytes) -> list[object]:
    out: list[object] = []
    for _, item in jsonl.read(io.BytesIO(data), "log", "requests"):
        if isinstance(item, dict):
            streamed = item.get("requests")
            if isinstance(streamed, jsonl.Streamed):
                item["requests"] = list(streamed)  # the keys after it arrive in `item` as it is read
            out.append(item)
        else:
            out.append(item if item is None else json.loads(item))
    return out


TEXT = st.text(alphabet=st.sampled_from('ab}{],["\\:é€\n\t 0'), max_size=12)
REQUEST = st.fixed_dictionaries(
    {"request_id": TEXT, "type": st.sampled_from(["new", "cached"]), "tokens": st.integers(0, 10**6)},
    optional={"x": st.lists(st.integers() | st.floats(allow_nan=False) | TEXT, max_size=3)},
)


@settings(max_examples=150, deadline=None)
@given(
    head=st.dictionaries(TEXT, st.integers() | TEXT | st.none(), max_size=3),
    requests=st.lists(REQUEST | st.integers() | TEXT, max_size=12),
    tail=st.dictionaries(st.sampled_from(["z", "tail"]), st.integers() | TEXT, max_size=2),
    compact=st.booleans(),
)
def test_a_streamed_line_reads_as_json_reads_it(head, requests, tail, compact) -> None:
    jsonl.CHUNK, jsonl.MARGIN, jsonl.BATCH = 64, 8, 40
    try:
        seps = (",", ":") if compact else (", ", ": ")
        doc = {**{k: v for k, v in head.items() if k != "requests"}, "requests": requests, **tail}
        line = json.dumps(doc, separators=seps, ensure_ascii=False).encode() + b"\n"
        short = json.dumps({"phase": "decode"}).encode() + b"\n"
        assert _read(line + short + line) == [json.loads(line), json.loads(short), json.loads(line)]
    finally:
        jsonl.CHUNK, jsonl.MARGIN, jsonl.BATCH = 1 << 20, 1 << 16, 1 << 16


def test_a_long_line_cut_short_is_never_read_as_another_line(small_reads) -> None:
    line = json.dumps(dispatch(1, 0, 0, "prefill", *[(f"id}}, {{{i}", "new", 3) for i in range(30)])).encode()
    for cut in range(70, len(line), 7):
        items = list(jsonl.read(io.BytesIO(line[:cut]), "log", "requests"))
        assert len(items) == 1
        item = items[0][1]
        if isinstance(item, dict):
            with pytest.raises(ValueError):
                list(item["requests"])
        else:
            assert item is None or not item.endswith(b"\n")


def _log(tmp_path: Path, lines: list[dict | str]) -> tuple[Path, Path]:
    r, t = tmp_path / "gen", tmp_path / "actor"
    write_jsonl(r / "100" / "dispatch_log.jsonl", lines)
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "a")])
    write_dump(r / "100" / "step0" / "rank0")
    write_dump(t / "300" / "step0" / "rank0")
    return r, t


BAD_TOKENS = [
    "Infinity",
    "-Infinity",
    "NaN",
    "1e400",
    "-1",
    "2.5",
    "5.0",
    '"5"',
    "true",
    "null",
    "1" + "0" * 20,
    "[3]",
]
SHOWN = {"1e400": "Infinity", "1" + "0" * 20: "100000000000000000000"}


@pytest.mark.parametrize("where", ["single prefill", "batched prefill", "decode", "long line"])
@pytest.mark.parametrize("token", BAD_TOKENS)
def test_token_counts_that_are_not_counts_are_bad_input(tmp_path, monkeypatch, where, token) -> None:
    if where == "long line":
        monkeypatch.setattr(jsonl, "CHUNK", 64)
        monkeypatch.setattr(jsonl, "BATCH", 40)
    reqs = (
        [("a", "new", 3)]
        if where == "single prefill"
        else [(f"r{i}", "new", 3) for i in range(12)] + [("a", "new", 3)]
    )
    phase = "decode" if where == "decode" else "prefill"
    line = json.dumps(dispatch(100, 0, 1, phase, *reqs))
    k = len(reqs) - 1
    line = line.replace('"tokens": 3}]', f'"tokens": {token}}}]')
    r, t = _log(tmp_path, [dispatch(100, 0, 0, "prefill", ("a", "new", 3)), line])
    code, out, err = run_cli("dumps", "correlate", str(r), str(t))
    shown = SHOWN.get(token, token)
    assert code == 2, (out, err)
    assert f"dispatch_log.jsonl:2: `requests[{k}].tokens` is {shown};" in err, err
    assert "pair" not in out


def test_a_token_count_of_a_real_run_still_pairs(tmp_path) -> None:
    r, t = _log(tmp_path, [dispatch(100, 0, 0, "prefill", ("a", "new", 2**31))])
    assert [p.request_id for p in correlate(r, t).pairs] == ["a"]


def test_a_step_of_many_requests_is_counted_not_listed(tmp_path, small_reads) -> None:
    reqs = [(f"{i:032x}-0000beef", "new", 5) for i in range(500)]
    r, t = _log(
        tmp_path, [dispatch(100, 0, 0, "prefill", ("a", "new", 3)), dispatch(100, 0, 1, "prefill", *reqs)]
    )
    result = correlate(r, t)
    batched = [u for u in result.unmatched if "together with other requests" in u.why]
    assert len(batched) == 21 and batched[0].request_id == f"{0:032x}"
    assert batched[-1].request_id is None and batched[-1].why.startswith("480 more requests")
    assert [p.request_id for p in result.pairs] == ["a"]


def test_a_long_prefill_line_cut_short_teaches_nothing(tmp_path, small_reads) -> None:
    """The rollout was killed while writing a step of many requests: that line is a bad line, and
    none of its requests is taken as prefilled together (they never were, as far as the log says)."""
    full = json.dumps(dispatch(100, 0, 1, "prefill", *[(f"r{i}", "new", 3) for i in range(40)]))
    r, t = _log(tmp_path, [dispatch(100, 0, 0, "prefill", ("a", "new", 3)), full[: len(full) // 2]])
    result = correlate(r, t)
    assert not [u for u in result.unmatched if "together" in u.why]
    assert any("dispatch_log.jsonl:2: not a JSON line" in u.why for u in result.unmatched)


def _dump(path: Path, entries: int, statistic: str = "1.5") -> bytes:
    data = ",\n".join(
        f' "op.{i}.forward": {{"output": [{{"Max": {statistic}, "Min": -1}}]}}' for i in range(entries)
    )
    text = f'{{\n "task": "statistics",\n "data": {{\n{data}\n }}\n}}\n'.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return text


@pytest.mark.parametrize("statistic", ["1.5", "NaN", "Infinity", "-Infinity"])
def test_dump_check_streams_and_a_nan_statistic_is_a_finding_not_a_broken_file(
    tmp_path, small_reads, statistic
):
    assert check_dump_file(tmp_path / "d.json") is not None  # missing
    _dump(tmp_path / "d.json", 50, statistic)
    assert check_dump_file(tmp_path / "d.json") is None


def test_dump_check_finds_a_dump_cut_anywhere(tmp_path, small_reads) -> None:
    text = _dump(tmp_path / "whole.json", 20)
    for cut in range(1, len(text) - 2, 13):
        (tmp_path / "d.json").write_bytes(text[:cut])
        why = check_dump_file(tmp_path / "d.json")
        assert why is not None and ("unparsable" in why or "no top-level" in why), (cut, why)


@pytest.mark.parametrize(
    "text,why",
    [
        ("[1, 2]", "no top-level `data`"),
        ('{"task": 1}', "no top-level `data`"),
        ('{"data": {}}', "`data` is empty"),
        ('{"data": []}', "`data` is empty"),
        ('{"data": {"a": 1}} x', "unparsable"),
        ('{"data": {"a": 1,}}', "unparsable"),
    ],
)
def test_dump_check_verdicts_on_small_documents(tmp_path, small_reads, text, why) -> None:
    (tmp_path / "d.json").write_text(text)
    assert why in (check_dump_file(tmp_path / "d.json") or "ok")


def test_a_long_line_whose_phase_comes_after_its_requests_reads_as_json_reads_it(
    tmp_path, small_reads
) -> None:
    """The helpers write `phase` before `requests`; an edited line with it after is read whole."""
    doc = dispatch(100, 0, 1, "prefill", *[(f"r{i}", "new", 3) for i in range(12)])
    phase = doc.pop("phase")
    r, t = _log(tmp_path, [dispatch(100, 0, 0, "prefill", ("a", "new", 3)), {**doc, "phase": phase}])
    result = correlate(r, t)
    assert result.skipped["rollout: prefill with several requests"] == 1
    assert [u.request_id for u in result.unmatched if "together" in u.why][:2] == ["r0", "r1"]


# what a hostile or edited log may hold where a request's fields are: every type, NaN, 1e400
ODD = st.integers(-2, 2**33) | st.floats() | st.booleans() | st.none() | TEXT
ANY_REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "request_id": TEXT | st.integers() | st.none(),
        "type": st.sampled_from(["new", "cached", "x", None, 5]),
        "tokens": st.integers(0, 2**31) | ODD,
        "extra": st.lists(ODD, max_size=2),
    },
)


# (CHUNK, MARGIN, BATCH): a few dozen bytes a read, with batches of one element or several
SIZES = [(64, 8, 40), (64, 8, 1000)]


def _outcome(requests: object, sizes: tuple[int, int, int]) -> object:
    """The requests correlate reads from one long prefill line holding REQUESTS (msgspec's typed
    batches, json where it refuses one; SIZES: jsonl's), or its UserError."""
    line = json.dumps({"phase": "prefill", "pad": "x" * 70, "requests": requests}).encode() + b"\n"
    saved = jsonl.CHUNK, jsonl.MARGIN, jsonl.BATCH
    jsonl.CHUNK, jsonl.MARGIN, jsonl.BATCH = sizes
    try:
        for _, doc in jsonl.read(io.BytesIO(line), "log", "requests", need=("phase",)):
            if not isinstance(doc, dict):
                doc = json.loads(doc or b"null")
            assert isinstance(doc, dict)
            return [r for batch in correlate_module._requests(doc, lambda: "log:1") for r in batch]
    except UserError as exc:
        return str(exc)
    finally:
        jsonl.CHUNK, jsonl.MARGIN, jsonl.BATCH = saved
    raise AssertionError("no line")


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(REQUEST | ANY_REQUEST | ODD, max_size=30), sizes=st.sampled_from(SIZES))
def test_requests_decoded_by_msgspec_are_the_requests_json_reads(requests, sizes) -> None:
    """A long line's requests, decoded a batch at a time by msgspec (validated in C), are what
    json's parse of the whole line gives, validated one by one: the same ids, types and token
    counts, or the same UserError naming the line and the request's index."""
    try:
        expected: object = [correlate_module._request(r, lambda: "log:1", k) for k, r in enumerate(requests)]
    except UserError as exc:
        expected = str(exc)
    assert _outcome(requests, sizes) == expected


def test_a_batch_msgspec_refuses_is_read_by_json(monkeypatch) -> None:
    """Requests as the helpers write them are msgspec's alone; a step whose requests carry NaN in a
    field rl-msprobe does not read, or a numeric id, is refused by msgspec and read by json, and is
    what it would be without the oddity; a bad count in it is still named by its index."""
    slow: list[object] = []
    real = correlate_module._request
    monkeypatch.setattr(correlate_module, "_request", lambda r, where, k: slow.append(r) or real(r, where, k))
    Request = correlate_module.Request
    plain = [{"request_id": f"r{i}", "type": "new", "tokens": 3} for i in range(3)]
    assert _outcome(plain, SIZES[1]) == [Request(f"r{i}", "new", 3) for i in range(3)] and not slow
    reqs = [{"request_id": f"r{i}", "type": "new", "tokens": 3, "score": float("nan")} for i in range(3)]
    reqs += [{"request_id": 7 + i, "type": "new", "tokens": 3} for i in range(3)]
    assert _outcome(reqs, SIZES[1]) == [
        *(Request(f"r{i}", "new", 3) for i in range(3)),
        *(Request(str(7 + i), "new", 3) for i in range(3)),
    ]
    assert len(slow) == 6
    bad = str(_outcome([*reqs, {"request_id": "z", "tokens": -1}], SIZES[1]))
    assert bad.startswith("log:1: `requests[6].tokens` is -1;")


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.text(alphabet=st.sampled_from("ab0f9-_P\n"), max_size=14), max_size=12))
def test_a_batch_of_ids_is_stripped_as_each_id_is(ids) -> None:
    fresh: list[str] = []
    correlate_module._stage([correlate_module.Request(i, "new") for i in ids], fresh, [])
    assert fresh == [strip_request_id(i) for i in ids]


ENTRY = (
    '{"input_args": [{"Max": %s, "Min": -1, "name": "a}, {b]"}], "input_kwargs": {}, "output": [{"Max": 2}]}'
)


@pytest.mark.parametrize("indent", [None, 1, "line"])
@pytest.mark.parametrize("statistic", ["1.5", "NaN"])
@pytest.mark.parametrize("small", [True, False])
def test_dump_check_reads_compact_indented_and_odd_entries(tmp_path, monkeypatch, indent, statistic, small):
    """Entries checked a batch at a time whatever the layout of the text (compact JSON, where the
    boundary between entries is also inside them; braces inside strings; NaN, which msgspec
    refuses and json reads); one broken entry among thousands is still found."""
    if small:
        for name, size in (("READ", 64), ("MARGIN", 8), ("BATCH", 40)):
            monkeypatch.setattr(jsonl, name, size)
    entries = {f"op.{i}.forward": json.loads(ENTRY % ("1.5" if i % 7 else statistic)) for i in range(3000)}
    if indent == "line":
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items())
        text = '{"task": "statistics", "data": {\n' + body + "\n }\n}\n"
    else:
        text = json.dumps({"task": "statistics", "data": entries}, indent=indent)
    path = tmp_path / "dump.json"
    path.write_text(text)
    assert check_dump_file(path) is None
    path.write_text(text.replace('"op.2500.forward": ', '"op.2500.forward": ,'))
    assert "unparsable" in (check_dump_file(path) or "")


JSONISH = st.text(alphabet=st.sampled_from('{}[]":,0123456789.eE-+ \t\nabtrufnlsNIy\\\x7fé'), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    text=JSONISH
    | st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | TEXT,
        lambda c: st.lists(c) | st.dictionaries(TEXT, c),
    ).map(json.dumps)
)
def test_a_short_line_decoded_by_msgspec_is_what_json_reads(tmp_path_factory, text) -> None:
    """msgspec decodes a short log line only where json reads it, and to the same object; a
    line it refuses goes to json (NaN, 5000 digits, bad JSON), so `read_jsonl` keeps json's
    verdict on every line."""
    try:
        expected: object = ("ok", json.loads(text))
    except (ValueError, RecursionError):
        expected = ("bad", None)
    if expected[0] == "ok" and type(expected[1]) is not dict:
        expected = ("not an object", None)
    log = tmp_path_factory.mktemp("log") / "update_actor_log.jsonl"
    log.write_text(text.replace("\n", " ") + "\n")
    bad: list[str] = []
    got = [obj for _, obj in correlate_module.read_jsonl(log, bad)]
    if got:
        assert expected == ("ok", got[0])
    elif bad:
        assert expected[0] == ("not an object" if bad[0].endswith("not a JSON object") else "bad"), bad
    else:
        assert not text.strip()

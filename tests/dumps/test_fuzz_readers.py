"""Property: every reader of run output (triage lines, dispatch and update-actor logs, dump.json)
ends with exit 0, 1 or 2 on hostile input, never a traceback, and stays within a stated memory bound.

The hostile shapes are the ones real damage and edits produce: a value of the wrong type under a
known key (a list for `step`, 5 for `mask`, a string for the log-probs), numbers past what Python's
json or numpy take (5000 digits, 30-digit token ids, 1e400, Infinity, NaN), token ids as large as
3e8 or 2**40 (per-token sums sized by them would need GiBs), lines that are not objects (a string,
100k nested `[`), invalid UTF-8, lines cut short. Each example runs the real command in-process;
tracemalloc (numpy reports to it) checks the peak. Few examples each (CI runs them derandomized).
`mismatch report` draws its plots under tracemalloc (~2.5 s an example): the default tier runs its
explicit examples (every hostile family: a huge or wrong-typed value, a whole bad line) and a few
generated ones, `--full` 30 generated ones.
"""

from __future__ import annotations

import json
import tracemalloc

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.dumps.conftest import dispatch, update, write_dump
from tests.support.tiers import examples
from tests.support.trees import run_cli

MEMORY_BOUND = 96 << 20  # bytes: the peak any one example may allocate (the inputs are < 1 MB)

# raw JSON texts of hostile values (written into a line as they are, so not only what json.dumps makes)
HOSTILE_RAW = st.one_of(
    st.sampled_from(
        [
            "null",
            "true",
            "5",
            "-1",
            '"ab"',
            "[]",
            "[1]",
            "[[1], [2]]",
            "{}",
            '{"a": 1}',
            "Infinity",
            "-Infinity",
            "NaN",
            "1e400",
            "9" * 30,
            "9" * 400,
            "9" * 5000,
            "300000000",
            str(2**40),
            "[" * 3000 + "]" * 3000,
            f"[{'9' * 30}, 1]",
            "[300000000, 2]",
            f"[{2**40}]",
            "[Infinity, NaN]",
            '["x", null, true]',
            '"\\ud800"',
        ]
    ),
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.text(max_size=8).map(json.dumps),
)
WHOLE_LINE = st.sampled_from(
    [
        b'"just a string"',
        b"12",
        b"null",
        b"[1, 2]",
        b"[" * 100_000,
        b'{"a":' * 20_000,
        b"\xff\xfe{}",
        b'{"step": 1, "x": "\xff"}',
        b"",
        b"   ",
        b'{"step": 1, "rollout_log_probs": [',
    ]
)


def _line(base: dict, edits: dict[str, str]) -> bytes:
    """`base` as JSON with some keys' values replaced by raw texts (placeholders keep key order)."""
    doc = {**base, **{k: f"@@{k}@@" for k in edits}}
    text = json.dumps(doc)
    for key, raw in edits.items():
        text = text.replace(json.dumps(f"@@{key}@@"), raw)
    return text.encode()


def _lines(base: dict, keys: list[str]) -> st.SearchStrategy[list[bytes]]:
    edited = st.dictionaries(st.sampled_from(keys), HOSTILE_RAW, min_size=1, max_size=3).map(
        lambda edits: _line(base, edits)
    )
    return st.lists(st.one_of(edited, WHOLE_LINE, st.just(_line(base, {}))), min_size=1, max_size=6)


def _run(*args: str) -> int:
    tracemalloc.start()
    try:
        code, _, err = run_cli(*args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code in (0, 1, 2), err
    assert "Traceback" not in err, err
    assert peak < MEMORY_BOUND, f"{args[:2]}: peak {peak >> 20} MiB"
    return code


TRIAGE = {
    "step": 1,
    "request_id": "r1",
    "uid": "u1",
    "index": 0,
    "prompt_len": 2,
    "train_dtype": "float32",
    "mask": [1, 1, 1],
    "prompt_ids": [5, 6],
    "response_ids": [7, 8, 9],
    "rollout_log_probs": [-0.5, -0.25, -1.0],
    "train_log_probs": [-0.5, -0.5, -1.5],
}
# no shrinking: each example runs a whole command (a failure prints its example as generated)
EXAMPLES = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

REPORT_EXAMPLES = settings(EXAMPLES, max_examples=examples(4, 30))


@REPORT_EXAMPLES
@given(lines=_lines(TRIAGE, list(TRIAGE)))
@example(  # values past what json and numpy take, under known keys
    lines=[
        _line(TRIAGE, {"step": "9" * 5000, "response_ids": f"[{2**40}]"}),
        _line(TRIAGE, {"rollout_log_probs": "[Infinity, NaN]", "prompt_len": "1e400"}),
        _line(TRIAGE, {"response_ids": "[300000000, 2]", "mask": "5"}),
    ]
)
@example(  # wrong types: a string, a list, an object, a float, text
    lines=[
        _line(TRIAGE, {"rollout_log_probs": '"ab"', "step": "[1]", "index": "-3"}),
        _line(TRIAGE, {"train_log_probs": '{"a": 1}', "prompt_len": "2.5", "uid": json.dumps("\u00e9")}),
    ]
)
@example(
    lines=[b"[" * 100_000, b"\xff\xfe{}", b'{"step": 1, "rollout_log_probs": [', b"", b"12"]
)  # not objects
def test_mismatch_report_never_tracebacks(tmp_path_factory, lines):
    folder = tmp_path_factory.mktemp("triage")
    (folder / "1").mkdir()
    (folder / "1" / "triage.jsonl").write_bytes(b"\n".join([_line(TRIAGE, {}), *lines]) + b"\n")
    _run("mismatch", "report", str(folder), "--out", str(folder / "report"), "--json")


DISPATCH = dispatch(100, 0, 0, "prefill", ("aaaa-0123abcd", "new", 7))
UPDATE = update(300, 0, 0, "aaaa")


@EXAMPLES
@given(
    rollout=_lines(DISPATCH, [*DISPATCH, "requests[0]"]),
    train=_lines(UPDATE, list(UPDATE)),
    request=st.dictionaries(st.sampled_from(["request_id", "type", "tokens"]), HOSTILE_RAW, max_size=2),
)
def test_dumps_correlate_never_tracebacks(tmp_path_factory, rollout, train, request):
    base = tmp_path_factory.mktemp("logs")
    r, t = base / "gen", base / "actor"
    edited_request = _line(DISPATCH["requests"][0], request).decode()
    first = _line({**DISPATCH, "requests": "@@R@@"}, {}).replace(b'"@@R@@"', f"[{edited_request}]".encode())
    (r / "100").mkdir(parents=True)
    (r / "100" / "dispatch_log.jsonl").write_bytes(b"\n".join([first, *rollout]) + b"\n")
    (t / "300").mkdir(parents=True)
    (t / "300" / "update_actor_log.jsonl").write_bytes(b"\n".join([_line(UPDATE, {}), *train]) + b"\n")
    write_dump(r / "100" / "step0" / "rank0")
    write_dump(t / "300" / "step0" / "rank0")
    _run("dumps", "correlate", str(r), str(t), "--json")


DUMP = {"task": "statistics", "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": {}}


@EXAMPLES
@given(
    edits=st.dictionaries(st.sampled_from([*DUMP, "data"]), HOSTILE_RAW, max_size=3),
    whole=st.none() | WHOLE_LINE,
    step=st.sampled_from(["0", "1", "7", "999999999999", "9" * 250]),
    rank=st.sampled_from(["0", "", "1000001", "9" * 250]),
    jobs=st.sampled_from(["1", "2"]),
)
def test_dumps_check_never_tracebacks(tmp_path_factory, edits, whole, step, rank, jobs):
    root = tmp_path_factory.mktemp("dumps")
    write_dump(root / "step0" / "rank0")
    folder = root / f"step{step}" / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dump.json").write_bytes(whole if whole is not None else _line(DUMP, edits))
    _run("dumps", "check", str(root), "--jobs", jobs, "--json")


WEIGHTS = {
    "stage": "sent",
    "sync": 1,
    "rank": 0,
    "index": 0,
    "name": "model.norm.weight",
    "dtype": "float32",
    "shape": [2],
    "fp": {"count": 2, "sum": 1.0, "sumsq": 1.0, "min": 0.0, "max": 1.0, "nan": 0, "inf": 0},
}
WEIGHTS_META = {"stage": "resident-meta", "sync": 1, "rank": 0, "tp_size": 1}


@EXAMPLES
@given(
    sent=_lines(WEIGHTS, list(WEIGHTS)),
    meta=_lines(WEIGHTS_META, list(WEIGHTS_META)),
)
def test_weights_compare_never_tracebacks(tmp_path_factory, sent, meta):
    folder = tmp_path_factory.mktemp("weights")
    (folder / "sent-1.jsonl").write_bytes(b"\n".join([_line(WEIGHTS, {}), *sent]) + b"\n")
    (folder / "received-2.jsonl").write_bytes(
        b"\n".join([*meta, _line({**WEIGHTS, "stage": "received"}, {})]) + b"\n"
    )
    _run("weights", "compare", str(folder), "--out", str(folder / "report"), "--json")

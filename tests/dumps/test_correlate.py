"""The DOMAIN §6 join on hand-made logs (see conftest.consistency_tree for the cases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_msprobe.dumps.correlate import correlate, strip_request_id
from rl_msprobe.errors import UserError
from tests.dumps.conftest import dispatch, update, write_dump, write_jsonl


def test_strip_request_id() -> None:
    assert strip_request_id("3f2a9c1e-0123abcd") == "3f2a9c1e"
    assert strip_request_id("chatcmpl-abc-deadbeef") == "chatcmpl-abc"
    assert strip_request_id("plainid") == "plainid"
    assert strip_request_id("x-0123abc") == "x-0123abc"  # 7 hex: not vLLM's suffix
    # verl's SGLang PD replica: `{id}_P` to the prefill server (that prefill pairs), `{id}_D` to decode
    assert strip_request_id("9b1d0c7e5f2a4e3b8c6d1a0f9e8d7c6b_P") == "9b1d0c7e5f2a4e3b8c6d1a0f9e8d7c6b"
    assert strip_request_id("9b1d0c7e5f2a4e3b8c6d1a0f9e8d7c6b_D") == "9b1d0c7e5f2a4e3b8c6d1a0f9e8d7c6b_D"
    assert strip_request_id("x-0123ABCD") == "x-0123ABCD"  # vLLM writes lower-case hex


@given(
    st.text(alphabet="abcdef0123456789-_", min_size=1, max_size=40),
    st.text(alphabet="0123456789abcdef", min_size=8, max_size=8),
)
def test_strip_is_inverse_of_vllm_suffix(base: str, suffix: str) -> None:
    stripped = strip_request_id(base)
    assert strip_request_id(f"{stripped}-{suffix}") == stripped


def _by_id(result) -> dict:
    return {p.request_id: p for p in result.pairs}


def _why(result, rid: str, side: str | None = None) -> str:
    hits = [u.why for u in result.unmatched if u.request_id == rid and (side is None or u.side == side)]
    assert hits, f"{rid} not explained: {result.unmatched}"
    return " / ".join(hits)


def test_pairs_across_pids_ranks_and_layouts(consistency_tree: tuple[Path, Path]) -> None:
    r, t = consistency_tree
    result = correlate(r, t)
    pairs = _by_id(result)
    assert set(pairs) == {"aaaa", "ffff"}
    a = pairs["aaaa"]
    assert (a.rollout.pid, a.rollout.rank, a.rollout.step) == (100, 0, 0)
    assert a.rollout.dump == str(r / "100" / "step0" / "rank0" / "dump.json")
    assert (a.train.pid, a.train.rank, a.train.step) == (300, 0, 0)
    assert a.train.dump == str(t / "300" / "step0" / "rank0" / "dump.json")
    f = pairs["ffff"]  # rank 1 on the rollout; training dumps without {pid} level, in proc{pid}
    assert (f.rollout.pid, f.rollout.rank) == (200, 1)
    assert f.train.dump == str(t / "step0" / "proc400" / "dump.json")


def test_every_skipped_request_is_explained(consistency_tree: tuple[Path, Path]) -> None:
    result = correlate(*consistency_tree)
    assert "together with other requests" in _why(result, "bbbb", "train")
    assert "together with other requests" in _why(result, "cccc", "rollout")
    assert "no training micro-batch" in _why(result, "dddd", "rollout")
    assert _why(result, "eeee", "rollout").startswith("missing dump: ")
    assert "step4" in _why(result, "eeee")
    assert "chunked prefill" in _why(result, "gggg", "rollout")
    assert "no rollout prefill step" in _why(result, "zzzz", "train")
    assert "held 2 requests" in _why(result, "hhhh", "train")
    assert "held 2 requests" in _why(result, "iiii", "train")
    cut = [u.why for u in result.unmatched if u.request_id is None]
    assert any("dispatch_log.jsonl:4: not a JSON line" in w for w in cut), cut


def test_line_counts(consistency_tree: tuple[Path, Path]) -> None:
    skipped = correlate(*consistency_tree).skipped
    assert skipped["rollout: decode step"] == 1
    assert skipped["rollout: prefill with several requests"] == 1
    assert skipped["rollout: one-request prefill"] == 5  # A, D, E, F, G
    assert skipped["rollout: prefill continuing a request (type cached)"] == 1
    assert skipped["train: micro-batch with several requests"] == 1
    assert skipped["train: no rollout match"] == 2  # B (batched), Z
    assert skipped["train: matched"] == 4  # A, E, F, G


def test_missing_log_is_bad_input(tmp_path: Path, consistency_tree: tuple[Path, Path]) -> None:
    r, _ = consistency_tree
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(UserError, match="update_actor_log.jsonl"):
        correlate(r, empty)
    with pytest.raises(UserError, match="dispatch_log.jsonl"):
        correlate(empty, r)


def test_used_lines_are_not_called_skipped(consistency_tree: tuple[Path, Path]) -> None:
    doc = correlate(*consistency_tree).to_json()
    assert doc["used_lines"] == {"rollout: one-request prefill": 5, "train: matched": 4}
    assert "train: matched" not in doc["skipped_lines"] and doc["skipped_lines"]["rollout: decode step"] == 1


@pytest.mark.parametrize("requests", ['"abc"', '{"request_id": "a"}', "7", '["a"]'])
def test_requests_of_the_wrong_shape_are_bad_input(tmp_path: Path, requests: str) -> None:
    r, t = tmp_path / "gen", tmp_path / "actor"
    line = json.dumps(dispatch(100, 0, 0, "prefill", ("a", "new", 3)))
    line = line[: line.index('"requests"')] + f'"requests": {requests}}}'
    write_jsonl(r / "100" / "dispatch_log.jsonl", [line])
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "a")])
    with pytest.raises(UserError, match=r"dispatch_log.jsonl:1: `requests` is"):
        correlate(r, t)


@pytest.mark.parametrize(
    ("key", "value"),
    [("pid", "/elsewhere"), ("pid", "../../x"), ("step", "0/../../x"), ("rank", -1), ("step", True)],
)
def test_ids_from_logs_must_be_digits(tmp_path: Path, key: str, value: object) -> None:
    r, t = tmp_path / "gen", tmp_path / "actor"
    write_jsonl(r / "100" / "dispatch_log.jsonl", [dispatch(100, 0, 0, "prefill", ("a", "new", 3))])
    write_dump(r / "100" / "step0" / "rank0")
    bad = {**update(300, 0, 0, "a"), key: value}
    write_jsonl(t / "300" / "update_actor_log.jsonl", [bad])
    with pytest.raises(UserError, match=f"update_actor_log.jsonl:1: `{key}` is"):
        correlate(r, t)


def test_deeply_nested_log_line_is_bad_input(tmp_path: Path) -> None:
    r, t = tmp_path / "gen", tmp_path / "actor"
    write_jsonl(r / "100" / "dispatch_log.jsonl", ["[" * 100_000 + "]" * 100_000])
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "a")])
    with pytest.raises(UserError, match="nested too deeply"):
        correlate(r, t)


def test_dump_symlinked_out_of_the_folder_is_not_paired(tmp_path: Path) -> None:
    r, t = tmp_path / "gen", tmp_path / "actor"
    write_jsonl(r / "100" / "dispatch_log.jsonl", [dispatch(100, 0, 0, "prefill", ("a", "new", 3))])
    write_dump(r / "100" / "step0" / "rank0")
    write_jsonl(t / "300" / "update_actor_log.jsonl", [update(300, 0, 0, "a")])
    outside = write_dump(tmp_path / "elsewhere" / "rank0")
    (t / "300" / "step0").mkdir(parents=True)
    (t / "300" / "step0" / "rank0").symlink_to(outside.parent)
    result = correlate(r, t)
    assert result.pairs == [] and any(u.why.startswith("missing dump") for u in result.unmatched)


def test_a_cache_hit_prefill_is_named_as_such(tmp_path: Path) -> None:
    """A request whose only prefill starts from cached tokens (seen live: SGLang's radix cache, the
    second sample of a prompt: `cached`, 1 token) is unpaired with the cache named as the reason."""
    rollout, train = tmp_path / "generate", tmp_path / "actor"
    write_jsonl(
        rollout / "7" / "dispatch_log.jsonl",
        [
            dispatch(7, 0, 0, "prefill", ("first", "new", 27)),
            dispatch(7, 0, 5, "prefill", ("second", "cached", 1)),
        ],
    )
    write_dump(rollout / "step0" / "rank0")
    write_dump(rollout / "step5" / "rank0")
    write_jsonl(train / "9" / "update_actor_log.jsonl", [update(9, 0, 0, "first"), update(9, 0, 1, "second")])
    write_dump(train / "step0" / "rank0")
    write_dump(train / "step1" / "rank0")
    result = correlate(rollout, train)
    assert [p.request_id for p in result.pairs] == ["first"]
    why = _why(result, "second", "train")
    assert "cache hit" in why and "step5, 1 token(s)" in why and "disable_radix_cache=True" in why

"""Hand-made dump trees and logs for the dumps tests (written here, no msprobe needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DUMP = {"task": "statistics", "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": {"x": {}}}


def write_dump(path: Path, doc: dict | str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    f = path / "dump.json"
    f.write_text(doc if isinstance(doc, str) else json.dumps(doc or DUMP))
    return f


def write_jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def dispatch(pid: int, rank: int, step: int, phase: str, *reqs: tuple[str, str, int]) -> dict:
    return {
        "source": "dispatch",
        "timestamp": 1.0 + step,
        "pid": pid,
        "rank": rank,
        "step": step,
        "phase": phase,
        "total_num_scheduled_tokens": sum(t for _, _, t in reqs),
        "requests": [{"request_id": rid, "type": kind, "tokens": t} for rid, kind, t in reqs],
    }


def update(pid: int, rank: int, step: int, *ids: str) -> dict:
    return {
        "source": "update_actor",
        "timestamp": 10.0 + step,
        "pid": pid,
        "rank": rank,
        "step": step,
        "request_ids": list(ids),
        "num_requests": len(ids),
    }


@pytest.fixture
def consistency_tree(tmp_path: Path) -> tuple[Path, Path]:
    """Two rollout pids (ranks 0 and 1) and two training pids, covering every join case.

    rollout pid 100 rank 0: step0 prefill A (suffix), step1 decode A, step2 prefill B+C,
                            step3 prefill D (no training line), step4 prefill E (dump missing)
    rollout pid 200 rank 1: step0 prefill F (no suffix), step1 prefill G then step2 G's
                            chunked rest, step3 a cut-short line
    training pid 300 rank 0 (with {pid} level): A, B, E, Z (no rollout match)
    training pid 400 rank 1 (dumps without {pid} level, proc{pid}): F, G, and one batch of two
    """
    r, t = tmp_path / "gen", tmp_path / "actor"
    write_jsonl(
        r / "100" / "dispatch_log.jsonl",
        [
            dispatch(100, 0, 0, "prefill", ("aaaa-0123abcd", "new", 7)),
            dispatch(100, 0, 1, "decode", ("aaaa-0123abcd", "cached", 1)),
            dispatch(100, 0, 2, "prefill", ("bbbb-00000000", "new", 5), ("cccc-11111111", "new", 4)),
            dispatch(100, 0, 3, "prefill", ("dddd-22222222", "new", 6)),
            dispatch(100, 0, 4, "prefill", ("eeee-33333333", "new", 6)),
        ],
    )
    for step in (0, 1, 2, 3):  # step4 (E) has no dump
        write_dump(r / "100" / f"step{step}" / "rank0")
    write_jsonl(
        r / "200" / "dispatch_log.jsonl",
        [
            dispatch(200, 1, 0, "prefill", ("ffff", "new", 3)),
            dispatch(200, 1, 1, "prefill", ("gggg-44444444", "new", 8)),
            dispatch(200, 1, 2, "prefill", ("gggg-44444444", "cached", 8)),
            '{"source": "dispatch", "pid": 200, "rank": 1, "st',
        ],
    )
    for step in (0, 1, 2):
        write_dump(r / "200" / f"step{step}" / "rank1")
    write_jsonl(
        t / "300" / "update_actor_log.jsonl",
        [
            update(300, 0, 0, "aaaa"),
            update(300, 0, 1, "bbbb"),
            update(300, 0, 2, "eeee"),
            update(300, 0, 3, "zzzz"),
        ],
    )
    for step in (0, 1, 2, 3):
        write_dump(t / "300" / f"step{step}" / "rank0")
    write_jsonl(
        t / "400" / "update_actor_log.jsonl",
        [update(400, 1, 0, "ffff"), update(400, 1, 1, "gggg"), update(400, 1, 2, "hhhh", "iiii")],
    )
    for step in (0, 1, 2):
        write_dump(t / f"step{step}" / "proc400")
    return r, t


# ------------------------------------------------------------ real msprobe dumps of one request
POSITION_STANDIN = Path(__file__).with_name("position_standin.py")
PLANT_DECODE = {"plant": "model.layers.1.mlp.down_proj", "when": "decode"}
PLANT_PREFILL = {"plant": "model.layers.0.self_attn.o_proj", "when": "prefill", "row": 3}
POSITION_RUNS = {  # process -> (side, msprobe task, TP size, the variants it writes as OUT/NAME)
    "rollout": (
        "rollout",
        "tensor",
        1,
        [
            {"name": "clean"},
            {"name": "decode_plant", **PLANT_DECODE},
            {"name": "prefill_plant", **PLANT_PREFILL},
        ],
    ),
    # decode steps in statistics mode: the bounded-size choice for the rollout
    "rollout_stats": (
        "rollout",
        "statistics",
        1,
        [
            {"name": "decode_plant_stats", "dump": "decode", **PLANT_DECODE},
            # every step in statistics mode: what a live rollout dumps (issue 32's whole-response run)
            {"name": "stats_clean"},
            {"name": "stats_decode_plant", **PLANT_DECODE},
            {"name": "stats_prefill_plant", **PLANT_PREFILL},
        ],
    ),
    "rollout_tp": ("rollout", "tensor", 2, [{"name": "tp"}]),  # ranks 0 and 1 of one gloo group
    "train": (
        "train",
        "tensor",
        1,
        [
            {"name": "train"},
            {"name": "train_flip", "flip": 10},
            {"name": "train_prompt", "prompt_only": True},
        ],
    ),
    # the verl engine hook's per-token records (DUMP_POSITIONS=1) of the same forward
    "train_records": (
        "train",
        "tensor",
        1,
        [{"name": "record", "per_token": True}, {"name": "record_flip", "per_token": True, "flip": 10}],
    ),
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_POSITION_DUMPS: dict[str, Path] = {}  # built once per session, whichever module asks first


@pytest.fixture(scope="session")
def position_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real msprobe tensor-mode dumps (position_standin.py) of one request: rollout roots
    (stepN = prefill, then decode steps) and training roots (step0 = the whole forward).
    Modules that import this fixture share the one build (`_POSITION_DUMPS`)."""
    if not _POSITION_DUMPS:
        _POSITION_DUMPS.update(_build_position_dumps(tmp_path_factory))
    return _POSITION_DUMPS


def _build_position_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import os
    import subprocess
    import sys

    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    pytest.importorskip("transformers", reason="transformers is in the `test` extra")
    base = tmp_path_factory.mktemp("positions")
    port = str(_free_port())
    procs = {}
    for proc, (side, task, world, variants) in POSITION_RUNS.items():
        for rank in range(world):
            env = {**os.environ, "STANDIN_TASK": task, "RANK": str(rank), "WORLD_SIZE": str(world)}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs[(proc, rank)] = subprocess.Popen(
                [
                    sys.executable,
                    str(POSITION_STANDIN),
                    side,
                    str(base / proc),
                    "--variants",
                    json.dumps(variants),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=base,
                env=env,
            )
    for key, p in procs.items():
        out, _ = p.communicate(timeout=1800)  # a loaded 2-core machine: ~1 min alone, 10x that seen
        assert p.returncode == 0, f"{key} failed:\n{out.decode(errors='replace')[-3000:]}"
    return {
        v["name"]: base / proc / v["name"] for proc, (*_, variants) in POSITION_RUNS.items() for v in variants
    }


def step_dumps(root: Path) -> list[list[Path]]:
    """Each msprobe step's dump.json files under ROOT (step order; TP ranks lowest first)."""
    steps = sorted(root.glob("step*"), key=lambda p: int(p.name[4:]))
    return [sorted(s.glob("*/dump.json"), key=lambda p: p.parent.name) for s in steps]

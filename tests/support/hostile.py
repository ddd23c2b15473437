"""Hostile inputs of issue 45, each built in a scratch folder and run through the real command line.

A case builds its input under a folder and returns the `rl-msprobe` arguments; `expect` is the exit
code and words of the one line the command must answer with. tests/test_hostile_inputs.py runs
every case in-process (CliRunner); benchmarks/bench_hostile_inputs.py runs each in a subprocess of
a given checkout (main or a branch) and measures its time and peak memory, for the before/after
table. A case that needs what this machine cannot give says so: `unreadable` marks the folders a
permission error is simulated on (the tests run as root, which reads everything), by the prelude
below, the one mock here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.dumps.test_fuzz_readers import TRIAGE  # a triage line as the verl-triage helper writes it

UNREADABLE = "unreadable-by-you"  # a folder of this name raises PermissionError when listed (PRELUDE)

# installed in-process (tests) or run first in the subprocess (bench): os.scandir of a folder named
# UNREADABLE fails as it does for a user without the read bit on a folder of someone else's
PRELUDE = f"""
import errno, os
_scandir = os.scandir
def _refusing(path='.'):
    if not isinstance(path, int) and os.path.basename(os.fsdecode(path).rstrip('/')) == {UNREADABLE!r}:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    return _scandir(path)
os.scandir = _refusing
"""


@dataclass(frozen=True)
class Case:
    name: str
    what: str  # the input, in words (the table's first column)
    build: Callable[[Path], list[str]]  # the folder to build in -> the command's arguments
    code: int  # the exit code it must end with
    words: str  # in its one line (stderr's first line, else stdout's verdict line)
    needs: str = ""  # "torch": the test extras; "release": verl 0.9.1 from the package index (cached)
    after: Callable[[Path], None] | None = None  # what must still hold after it (the user's bytes)


# ---------------------------------------------------------------- weights compare --checkpoint


def _weights_run(folder: Path) -> Path:
    from tests.weights import synthetic

    return synthetic.write(folder / "w", syncs=1, tp=1)


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], tail: bytes = b"") -> None:
    header: dict[str, object] = {}
    blobs, offset = [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs) + tail)


def _checkpoint_of_run(folder: Path) -> Path:
    """The run's own weights at sync 1 as a checkpoint (equal to what the engine holds)."""
    from tests.weights import synthetic

    tensors = {n: ("F32", list(t.shape), t.numpy().tobytes()) for n, t in synthetic.model(1).items()}
    _safetensors(folder / "ckpt" / "model.safetensors", tensors)
    return folder / "ckpt"


def _checkpoint_case(edit: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(folder: Path) -> list[str]:
        run = _weights_run(folder)
        ckpt = _checkpoint_of_run(folder)
        edit(ckpt)
        return ["weights", "compare", str(run), "--checkpoint", str(ckpt)]

    return build


def _offsets_disagree(ckpt: Path) -> None:
    """One tensor's offsets one element short of its shape (the data still covers the file)."""
    path = ckpt / "model.safetensors"
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + size])
    data = path.read_bytes()[8 + size :]
    name = "model.norm.weight"
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end - 4]
    for other in header.values():  # the tensors after it move down, so only this one disagrees
        if other["data_offsets"][0] > start:
            other["data_offsets"] = [other["data_offsets"][0] - 4, other["data_offsets"][1] - 4]
    data = data[: end - 4] + data[end:]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _index(ckpt: Path, shards: dict[str, str]) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))


def _missing_shard(ckpt: Path) -> None:
    os.rename(ckpt / "model.safetensors", ckpt / "model-00001-of-00002.safetensors")
    _index(
        ckpt,
        {"model.norm.weight": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"},
    )


def _folder_shard(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()


def _fifo_shard(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")


def _zero_shard(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to("/dev/zero")


def _zero_index(ckpt: Path) -> None:
    (ckpt / "model.safetensors.index.json").symlink_to("/dev/zero")


def _fifo_index(ckpt: Path) -> None:
    os.mkfifo(ckpt / "model.safetensors.index.json")


def _cut_shard(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _huge_header(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")


def _f8_tensor(ckpt: Path) -> None:
    """The final norm stored as 8-bit floats (as FP8 checkpoints store their weights)."""
    path = ckpt / "model.safetensors"
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + size])
    data = path.read_bytes()[8 + size :]
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = data[start:end]
        if name == "model.norm.weight":
            tensors[name] = ("F8_E4M3", info["shape"], bytes(len(raw) // 4))
        else:
            tensors[name] = (info["dtype"], info["shape"], raw)
    _safetensors(path, tensors)


# ---------------------------------------------------------------- mismatch report, dumps check


def _triage_folder(folder: Path, pids: list[str]) -> Path:
    root = folder / "triage"
    for i, pid in enumerate(pids):
        (root / pid).mkdir(parents=True)
        doc = {**TRIAGE, "request_id": f"r{i}", "index": i}
        (root / pid / "triage.jsonl").write_text(json.dumps(doc) + "\n")
    return root


def _unreadable_pid(folder: Path) -> list[str]:
    root = _triage_folder(folder, ["1000", UNREADABLE])
    return ["mismatch", "report", str(root), "--out", str(folder / "report")]


def _non_utf8_names(folder: Path) -> list[str]:
    root = _triage_folder(folder, ["1000"])
    os.rename(root / "1000", os.fsdecode(os.fsencode(str(root)) + b"/pid-\xff\xfe"))
    return ["mismatch", "report", str(root), "--out", str(folder / "report")]


def _dump_folder(folder: Path, make: Callable[[Path], None]) -> list[str]:
    path = folder / "dumps" / "step0" / "rank0" / "dump.json"
    path.parent.mkdir(parents=True)
    make(path)
    return ["dumps", "check", str(folder / "dumps")]


def _nested(folder: Path) -> list[str]:
    """1,100 nested folders with a triage log at the bottom (made folder by folder: no recursion)."""
    here = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(1100):
            os.mkdir("d", dir_fd=here)
            inner = os.open("d", os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = inner
        fd = os.open("triage.jsonl", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=here)
        os.write(fd, (json.dumps(TRIAGE) + "\n").encode())
        os.close(fd)
    finally:
        os.close(here)
    return ["mismatch", "report", str(folder), "--out", str(folder / "report")]


# ---------------------------------------------------------------- dumps positions (per-token records)


LENGTHS = {"A": (3, 3), "B": (2, 4)}


def _records_job(folder: Path) -> Path:
    from tests.dumps import record_models as rm

    return rm.write_job(folder / "rec", rm.tokens_of(LENGTHS), {}, rm.batched_schedule(LENGTHS), [["A", "B"]])


def _last_decode_record_lost(folder: Path) -> list[str]:
    """The rollout's last decode step of request B never written (a killed worker): B is one
    position short of its response."""
    job = _records_job(folder)
    records = sorted((job / "rollout").glob("*/rec*.json"), key=lambda p: int(p.stem[3:]))
    last = records[-1]
    last.unlink()
    last.with_suffix(".f32").unlink()
    return ["dumps", "positions", str(job), "--out", str(folder / "report")]


def _triage_cut(folder: Path) -> list[str]:
    """--triage: the triage log's last line (request A's) cut short by a killed run."""
    job = _records_job(folder)
    root = folder / "triage" / "1000"
    root.mkdir(parents=True)
    line = json.dumps({**TRIAGE, "request_id": "A"})
    (root / "triage.jsonl").write_text(json.dumps({**TRIAGE, "request_id": "B"}) + "\n" + line[:-20])
    return [
        "dumps",
        "positions",
        str(job),
        "--out",
        str(folder / "report"),
        "--triage",
        str(folder / "triage"),
    ]


# ---------------------------------------------------------------- patch apply / revert (no user byte lost)


HELPER = "verl/utils/rl_msprobe_triage.py"


def _tree(folder: Path, with_git: bool) -> Path:
    from tests.support.trees import run_cli, scratch_copy

    tree = scratch_copy("verl", "0.9.1", folder / "verl", with_git=with_git)
    code, _, err = run_cli(
        "patch", "apply", "verl-triage", "--tree", str(tree), *(["--no-branch"] if with_git else [])
    )
    assert code == 0, err
    return tree


def _edited_helper_plain_revert(folder: Path) -> list[str]:
    tree = _tree(folder, with_git=False)
    with open(tree / HELPER, "a") as handle:
        handle.write("# the user's edit\n")
    return ["patch", "revert", "verl-triage", "--tree", str(tree)]


def _edited_helper_git_apply(folder: Path) -> list[str]:
    from tests.support.trees import git

    tree = _tree(folder, with_git=True)
    with open(tree / HELPER, "a") as handle:
        handle.write("# the user's edit\n")
    git(tree, "commit", "-qam", "my edit of the triage helper")
    return ["patch", "apply", "verl-triage", "--tree", str(tree)]


def _link_out_of_plain_tree(folder: Path) -> list[str]:
    from tests.support.trees import scratch_copy

    tree = scratch_copy("verl", "0.9.1", folder / "verl", with_git=False)
    target = tree / "verl/trainer/ppo/ray_trainer.py"
    outside = folder / "outside.py"
    shutil.copyfile(target, outside)
    target.unlink()
    target.symlink_to(outside)
    return ["patch", "apply", "verl-triage", "--tree", str(tree)]


def _escaped_space(folder: Path) -> list[str]:
    """A launch script whose continuation backslash has a space after it (line 4)."""
    script = folder / "run.sh"
    script.write_text(
        "#!/bin/bash\nset -x\npython3 -m verl.trainer.main_ppo \\\n    algorithm.adv_estimator=grpo \\ \n"
        "    actor_rollout_ref.rollout.name=vllm \\\n    trainer.n_gpus_per_node=2\n"
    )
    return ["detect", str(script)]


def _edit_kept(folder: Path) -> None:
    assert "# the user's edit" in (folder / "verl" / HELPER).read_text(), "the user's edit is gone"


def _outside_untouched(folder: Path) -> None:
    from rl_msprobe.upstream.release_cache import fetch_release

    original = (fetch_release("verl", "0.9.1") / "verl/trainer/ppo/ray_trainer.py").read_bytes()
    assert (folder / "outside.py").read_bytes() == original, "written through the link"


CASES = [
    Case(
        "ckpt-offsets",
        "checkpoint: offsets disagree with a shape",
        _checkpoint_case(_offsets_disagree),
        2,
        "tensor model.norm.weight has offsets",
        "torch",
    ),
    Case(
        "ckpt-missing-shard",
        "checkpoint: index names a missing shard",
        _checkpoint_case(_missing_shard),
        2,
        "which",
        "torch",
    ),
    Case(
        "ckpt-folder-shard",
        "checkpoint: a folder where a shard should be",
        _checkpoint_case(_folder_shard),
        2,
        "is a folder, not a regular file",
        "torch",
    ),
    Case(
        "ckpt-fifo-shard",
        "checkpoint: shard is a FIFO",
        _checkpoint_case(_fifo_shard),
        2,
        "is a named pipe (FIFO)",
        "torch",
    ),
    Case(
        "ckpt-zero-shard",
        "checkpoint: shard links to /dev/zero",
        _checkpoint_case(_zero_shard),
        2,
        "is a character device",
        "torch",
    ),
    Case(
        "ckpt-zero-index",
        "checkpoint: index links to /dev/zero",
        _checkpoint_case(_zero_index),
        2,
        "is a character device",
        "torch",
    ),
    Case(
        "ckpt-fifo-index",
        "checkpoint: index is a FIFO",
        _checkpoint_case(_fifo_index),
        2,
        "is a named pipe (FIFO)",
        "torch",
    ),
    Case(
        "ckpt-cut",
        "checkpoint: shard cut short",
        _checkpoint_case(_cut_shard),
        2,
        "not a valid safetensors file",
        "torch",
    ),
    Case(
        "ckpt-huge-header",
        "checkpoint: header length 2^60",
        _checkpoint_case(_huge_header),
        2,
        "not a valid safetensors file (header too large)",
        "torch",
    ),
    Case(
        "ckpt-f8", "checkpoint: an F8_E4M3 tensor", _checkpoint_case(_f8_tensor), 1, "NOT COMPARED", "torch"
    ),
    Case(
        "report-unreadable-pid",
        "mismatch report: a pid folder cannot be listed (simulated)",
        _unreadable_pid,
        2,
        "cannot be listed (Permission denied)",
    ),
    Case("report-non-utf8", "mismatch report: non-UTF-8 folder name", _non_utf8_names, 0, "report:"),
    Case("report-nested", "mismatch report: 1,100 nested folders", _nested, 2, "no triage.jsonl below it"),
    Case(
        "check-fifo",
        "dumps check: dump.json is a FIFO",
        lambda f: _dump_folder(f, os.mkfifo),
        1,
        "is a named pipe (FIFO), not a regular file",
    ),
    Case(
        "check-device",
        "dumps check: dump.json links to /dev/null",
        lambda f: _dump_folder(f, lambda p: p.symlink_to("/dev/null")),
        1,
        "is a character device",
    ),
    Case(
        "positions-short",
        "dumps positions: rollout record one decode step short",
        _last_decode_record_lost,
        1,
        "B: NOT COMPARED: the rollout has no record of position(s) 4",
        "torch",
    ),
    Case(
        "positions-triage-cut",
        "dumps positions --triage: last triage line cut",
        _triage_cut,
        0,
        "CONSISTENT",
        "torch",
    ),
    Case(
        "detect-escaped-space",
        "detect: a backslash followed by a space in the verl command",
        _escaped_space,
        2,
        "run.sh:4: a backslash followed by a space ends the verl command here",
    ),
    Case(
        "revert-edited-helper",
        "patch revert (plain tree): helper edited by the user",
        _edited_helper_plain_revert,
        2,
        "edited since rl-msprobe wrote it; the revert would delete your edits",
        "release",
        _edit_kept,
    ),
    Case(
        "apply-edited-helper",
        "patch apply (git tree): committed edit of the helper",
        _edited_helper_git_apply,
        2,
        "edited since rl-msprobe wrote it; apply would replace your edits",
        "release",
        _edit_kept,
    ),
    Case(
        "apply-link-out",
        "patch apply (plain tree): a file links out of the tree",
        _link_out_of_plain_tree,
        2,
        "outside the tree",
        "release",
        _outside_untouched,
    ),
]


def first_line(out: str, err: str) -> str:
    """The line a user reads first: a traceback's last line, an error on stderr, else the first line
    of stdout that is a problem or a verdict (else its first line)."""
    errors = [line for line in err.splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in errors):
        return errors[-1]
    if errors:
        return errors[0]
    shown = [line for line in out.splitlines() if line.strip()]
    verdicts = [
        line for line in shown if line.startswith(("problem:", "NOT COMPARED", "DIVERGENT", "CONSISTENT"))
    ]
    return verdicts[0] if verdicts else (shown[0] if shown else "")


@dataclass(frozen=True)
class Measured:
    code: int | None  # None: killed at the time limit
    out: str
    err: str
    seconds: float
    peak_rss: int  # bytes: the command's own peak resident memory (GNU time's %M); -1: killed, unknown


def measure(args: list[str], checkout: Path, limit_s: float = 30.0, address_space: int = 4 << 30) -> Measured:
    """`rl-msprobe ARGS` run by CHECKOUT's code in a process of its own (PRELUDE first): its wall time
    and peak resident memory as GNU time reports them (`/usr/bin/time -f %M`, which forks it from its
    own small process: a child forked from this one would count this process's memory, the case
    builders' torch included, in its peak); killed past LIMIT_S, and its address space capped at
    ADDRESS_SPACE by prlimit (an unbounded reader of /dev/zero ends in MemoryError there instead of
    taking the shared machine's memory)."""
    code = (
        PRELUDE
        + "\nimport sys\nfrom rl_msprobe.cli import main\nmain(args=sys.argv[1:], prog_name='rl-msprobe')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(checkout), "MPLBACKEND": "Agg"}
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile() as peak,
    ):
        argv = ["/usr/bin/time", "-f", "%M", "-o", peak.name, "prlimit", f"--as={address_space}"]
        started = time.monotonic()
        proc = subprocess.Popen(
            [*argv, sys.executable, "-c", code, *args],
            cwd=checkout,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: a kill at the limit reaches the command too
        )
        killed = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            killed = True
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        reported = Path(peak.name).read_text().split()
        return Measured(
            None if killed else proc.returncode,
            out.read().decode("utf-8", "replace"),
            err.read().decode("utf-8", "replace"),
            seconds,
            int(reported[-1]) * 1024 if reported and reported[-1].isdigit() else -1,
        )

"""Every output of several files is all or nothing (issue 34, item 4): `prepare`, `mismatch report
--out`, `weights compare --out` and `dumps compare`'s report folder are put in place in one publish
step (rl_msprobe/publishing.py).

Each output is written once from input A (the "old" outputs), then from input B with a write
failure injected at call k of every file-system call of the publish step (create, write, rename),
for every k until the run no longer reaches call k: the folder is then byte-for-byte the old
outputs, the exit code 2 and the message one line naming the file. A run killed at call k (its
process ends there, as with SIGKILL) is recognised by the next run as its own: that rerun, without
--force, leaves exactly the new outputs. `dumps compare`'s `pairs/` folder (what the real msprobe
writes) is built in a temporary sibling and renamed into place as a unit: a full disk while msprobe
compares, a failing rename and a kill mid-swap all leave the earlier pairs folder byte for byte.

`mismatch report`'s two plots are drawn once per triage (`drawn_once`): matplotlib takes ~0.4 s a
figure and the matrices run the report ~100 times on two inputs; the publish step still gets the
real PNG bytes of each input.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rl_msprobe import publishing
from tests.dumps.conftest import write_jsonl
from tests.planner.conftest import CORPUS
from tests.support.trees import run_cli
from tests.weights import synthetic

CALLS = ("_create", "_write", "_rename")
_PLOTS: dict[str, tuple[dict[str, str], dict[str, bytes], str | None]] = {}


@pytest.fixture(autouse=True)
def drawn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mismatch report`'s plots, drawn by the real code once per triage result (its pickled state,
    so a different input is drawn afresh); the forked runs inherit what the parent drew."""
    from rl_msprobe.triage import report
    from rl_msprobe.triage.stream import Triage

    real = report.plots

    def plots(result: Triage) -> tuple[dict[str, str], dict[str, bytes], str | None]:
        key = hashlib.sha256(pickle.dumps(result)).hexdigest()
        if key not in _PLOTS:
            _PLOTS[key] = real(result)
        return _PLOTS[key]

    monkeypatch.setattr(report, "plots", plots)


@dataclass
class Output:
    """One multi-file output: the folder it lands in, and the commands writing it from A and from B."""

    folder: Path
    old: Callable[[], tuple[int, str]]
    new: Callable[[], tuple[int, str]]


def triage_log(folder: Path, growth: float) -> Path:
    lines = [
        {
            "step": step,
            "request_id": f"r{step}{i}",
            "response_ids": [3, 4, 5],
            "rollout_log_probs": [-0.1, -0.2, -0.3],
            "train_log_probs": [-0.1, -0.2 - step * growth, -0.3],
        }
        for step in (1, 2, 3)
        for i in range(3)
    ]
    write_jsonl(folder / "7" / "triage.jsonl", lines)
    return folder


def cli(*args: str) -> tuple[int, str]:
    code, _, err = run_cli(*args)
    return code, err


def prepare(base: Path) -> Output:
    script = base / "job" / "run_job.sh"
    script.parent.mkdir(parents=True)
    script.write_bytes((CORPUS / "run_qwen2_7b_grpo_fsdp_vllm.sh").read_bytes())
    return Output(
        script.parent,
        lambda: cli("prepare", str(script), "--mode", "training", "--steps", "2"),
        lambda: cli("prepare", str(script), "--mode", "training", "--steps", "3"),
    )


def mismatch(base: Path) -> Output:
    a, b, out = triage_log(base / "a", 0.1), triage_log(base / "b", 0.3), base / "out"
    return Output(
        out,
        lambda: cli("mismatch", "report", str(a), "--out", str(out)),
        lambda: cli("mismatch", "report", str(b), "--out", str(out)),
    )


def weights(base: Path) -> Output:
    a = synthetic.write(base / "a", syncs=2)
    b = synthetic.write(
        base / "b", syncs=2, faults=[(2, "resident", "model.layers.1.self_attn.k_proj.weight", 1, 1.001)]
    )
    out = base / "out"
    return Output(
        out,
        lambda: cli("weights", "compare", str(a), "--out", str(out)),
        lambda: cli("weights", "compare", str(b), "--out", str(out)),
    )


def compare_report(base: Path) -> Output:
    from rl_msprobe.dumps.compare import CompareRun
    from rl_msprobe.dumps.report import write_report
    from rl_msprobe.errors import UserError

    out = base / "out"

    def write(backend: str) -> tuple[int, str]:
        try:
            write_report(CompareRun(out=out, backend=backend))
        except UserError as exc:
            return 2, f"error: {exc}\n"
        return 0, ""

    return Output(out, lambda: write("fsdp"), lambda: write("megatron"))


OUTPUTS = {
    "prepare": prepare,
    "mismatch-report": mismatch,
    "weights-compare": weights,
    "compare-report": compare_report,
}


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def states(make: Callable[[Path], Output], base: Path) -> tuple[Output, dict[str, bytes], dict[str, bytes]]:
    """An output after its A run (returned, ready for B), and the folder after A and after A then B."""
    reference = make(base / "w")
    assert reference.old()[0] in (0, 1)
    old = files(reference.folder)
    assert reference.new()[0] in (0, 1)
    new = files(reference.folder)
    assert old != new and set(old) <= set(new), "B must rewrite A's files"
    output = again(make, base)  # the same paths again (reports name their inputs)
    assert files(output.folder) == old, "the outputs are not reproducible"
    return output, old, new


def again(make: Callable[[Path], Output], base: Path) -> Output:
    """The output made afresh at the same paths, its A run done."""
    shutil.rmtree(base / "w")
    output = make(base / "w")
    assert output.old()[0] in (0, 1)
    return output


class Fault:
    """Make publishing's CALL fail (ENOSPC) at its k-th use; counts the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, call: str, k: int) -> None:
        self.k, self.calls, real = k, 0, getattr(publishing, call)

        def failing(*args: object, **kwargs: object) -> object:
            self.calls += 1
            if self.calls == self.k:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))
            return real(*args, **kwargs)

        monkeypatch.setattr(publishing, call, failing)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("kind", list(OUTPUTS))
def test_a_failure_at_every_write_point_leaves_the_old_outputs(kind, call, tmp_path, monkeypatch):
    output, old, new = states(OUTPUTS[kind], tmp_path)
    failures = 0
    for k in range(1, 200):
        with monkeypatch.context() as patch:
            fault = Fault(patch, call, k)
            code, err = output.new()
        if fault.calls < k:  # never reached call k: the run went through
            assert code in (0, 1), err
            assert files(output.folder) == new
            break
        failures += 1
        assert code == 2, (k, err)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err, (k, err)
        named = lines[0].removeprefix("error: ").split(": ", 1)[0]  # the file the user knows, no temporary
        temporary = re.search(r"\.rl-msprobe-\d+\.(tmp|old)$", named)
        assert named.startswith(str(output.folder)) and not temporary, (k, err)
        assert files(output.folder) == old, f"{call} failing at call {k}: the folder is not the old outputs"
    else:
        raise AssertionError("the publish step never ended")
    assert failures >= (3 if call != "_write" else 2), f"{call}: only {failures} calls: is it used?"


def killed_at(run: Callable[[], tuple[int, str]], call: str, k: int) -> bool:
    """Run in a forked child whose process ends at the k-th CALL of publishing; True if it got there."""
    pid = os.fork()
    if pid == 0:
        calls = 0
        real = getattr(publishing, call)

        def dying(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == k:
                os._exit(137)  # like SIGKILL: no cleanup of any kind
            return real(*args, **kwargs)

        setattr(publishing, call, dying)
        try:
            run()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) == 137


@pytest.mark.parametrize("call", ["_rename", "_write"])
@pytest.mark.parametrize("kind", ["prepare", "mismatch-report", "weights-compare"])
def test_a_run_killed_while_publishing_is_recognised_by_the_rerun(kind, call, tmp_path):
    make = OUTPUTS[kind]
    _, old, new = states(make, tmp_path)
    for k in range(1, 200):
        output = again(make, tmp_path)
        if not killed_at(output.new, call, k):
            assert files(output.folder) == new
            break
        left = files(output.folder)
        assert left != new or k > 1  # cut short: at most the new files, never a third state once recovered
        code, err = output.new()  # the same command again, no --force: its partial output is its own
        assert code in (0, 1), (k, err)
        assert files(output.folder) == new, f"killed at {call} {k}, then run again"
    else:
        raise AssertionError("the publish step never ended")


def test_recovery_alone_gives_the_old_or_the_new_outputs(tmp_path):
    """Killed at each rename and at each removal (after the record's rename: the commit point), the
    folder once recovered (no new run) is exactly A's or B's outputs, and both happen."""
    _, old, new = states(weights, tmp_path)
    seen = set()
    for call in ("_rename", "_unlink"):
        for k in range(1, 200):
            output = again(weights, tmp_path)
            if not killed_at(output.new, call, k):
                break
            publishing.recover_at(output.folder)
            after = files(output.folder)
            assert after in (old, new), f"killed at {call} {k}: neither the old outputs nor the new"
            seen.add("old" if after == old else "new")
    assert seen == {"old", "new"}, seen


def test_a_users_file_made_after_a_kill_is_never_removed(tmp_path):
    output, old, _ = states(mismatch, tmp_path)
    shutil.rmtree(output.folder)
    output.folder.mkdir()
    assert killed_at(output.new, "_rename", 3)
    intent = json.loads((output.folder / publishing.INTENT).read_text())
    fresh = [i["name"] for i in intent["items"] if not (output.folder / i["name"]).exists()]
    assert fresh, "a name not yet in place"
    (output.folder / fresh[0]).write_text("the user's own file\n")
    publishing.recover_at(output.folder)
    assert (output.folder / fresh[0]).read_text() == "the user's own file\n"
    assert not (output.folder / publishing.INTENT).exists()


# ---------------------------------------------------------------- dumps compare's pairs folder


@pytest.fixture
def compared(tmp_path) -> tuple[Callable[[], tuple[int, str]], Path, dict[str, bytes]]:
    """Two real dump folders compared once by the real msprobe (the earlier pairs), and the command."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    from tests.dumps.conftest import write_dump

    write_dump(tmp_path / "a" / "step0" / "rank0")
    write_dump(tmp_path / "b" / "step0" / "rank0")
    out = tmp_path / "o"

    def run() -> tuple[int, str]:
        return cli("dumps", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out))

    assert run()[0] in (0, 1)
    assert (out / "pairs" / "001_step0_rank0" / "msprobe.log").is_file()
    return run, out, files(out)


def test_the_pairs_folder_is_replaced_as_a_unit_or_not_at_all(compared, monkeypatch):
    run, out, before = compared
    from rl_msprobe.dumps import runners

    def full(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "pairs" / "001_step0_rank0"))

    with monkeypatch.context() as patch:  # the disk fills while msprobe compares
        patch.setattr(runners.WorkerRunner, "run", full)
        code, err = run()
    assert code == 2 and "No space left on device" in one_error(err) and "is as it was" in err
    assert files(out) == before and not leftovers(out)
    for k in (1, 2):  # the swap's two renames (the old folder aside, the new one in)
        with monkeypatch.context() as patch:
            fault = Fault(patch, "_rename_path", k)
            code, err = run()
        assert fault.calls >= k and code == 2 and "could not be put in place" in one_error(err), (k, err)
        assert files(out) == before and not leftovers(out)
    code, err = run()
    assert code in (0, 1), err
    after = files(out)
    assert after != before and set(after) == set(before), "a new pairs folder, the same names"


def test_a_run_killed_in_the_middle_of_the_swap_gets_the_earlier_pairs_back(compared):
    run, out, before = compared
    assert killed_at(run, "_rename_path", 2)  # the old folder aside, the new one not yet in
    assert not (out / "pairs").exists()
    publishing.recover_folder(out / "pairs")
    assert files(out) == before and not leftovers(out)
    assert killed_at(run, "_rename_path", 2)
    code, err = run()  # the rerun itself recovers, then goes through
    assert code in (0, 1), err
    assert set(files(out)) == set(before) and not leftovers(out)


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def leftovers(out: Path) -> list[str]:
    """Temporary or kept-aside pairs folders beside <out>/pairs."""
    return [p.name for p in out.iterdir() if p.name.startswith(".pairs.")]

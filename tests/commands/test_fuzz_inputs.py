"""Property: whatever the input, `patch` and `prepare` end with exit 0, 1 or 2, never a traceback,
and an exit 2 leaves the tree (or the script's folder) exactly as it was.

Inputs are the real verl 0.9.1 engine files and a real launch script from the corpus, mangled
(byte-order marks, CR-only or mixed line endings, stray bytes, truncation) and combined with odd
option values. Few examples each (CI runs them derandomized, see tests/conftest.py).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.trees import release_subset, run_cli, tree_state

pytestmark = pytest.mark.release
SET = "verl-engine"
PATHS = [
    "verl/utils/rl_msprobe_hooks.py",
    "verl/workers/engine/fsdp/transformer_impl.py",
    "verl/workers/engine/megatron/transformer_impl.py",
]
SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "launch" / "run_qwen2_7b_grpo_fsdp_vllm.sh"
_TEMPLATES: dict[bool, Path] = {}


def _template(with_git: bool) -> Path:
    if with_git not in _TEMPLATES:
        base = Path(tempfile.mkdtemp(prefix="rl-msprobe-fuzz-"))
        atexit.register(shutil.rmtree, base, True)
        _TEMPLATES[with_git] = release_subset("verl", "0.9.1", base / "verl", PATHS, with_git=with_git)
    return _TEMPLATES[with_git]


def _mangle(data: bytes, how: str, where: float, junk: bytes) -> bytes:
    at = int(len(data) * where)
    return {
        "keep": data,
        "bom": b"\xef\xbb\xbf" + data,
        "cr": data.replace(b"\n", b"\r"),
        "crlf": data.replace(b"\n", b"\r\n"),
        "mixed": data[:at] + data[at:].replace(b"\n", b"\r\n", 3),
        "insert": data[:at] + junk + data[at:],
        "truncate": data[:at],
        "empty": b"",
    }[how]


MANGLE = st.tuples(
    st.sampled_from(["keep", "bom", "cr", "crlf", "mixed", "insert", "truncate", "empty"]),
    st.floats(0, 1),
    st.binary(max_size=8),
)
ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    with_git=st.booleans(),
    command=st.sampled_from(["apply", "revert", "status", "diff"]),
    target=st.sampled_from(PATHS[1:]),
    mangle=MANGLE,
    branch=st.none() | ODD_TEXT,
    manifest=st.none() | ODD_TEXT | st.sampled_from(["[]", '{"files": 1}', '{"files": {"a": []}}']),
)
@example(  # found by this test: a NUL byte in --branch was a ValueError from subprocess
    with_git=True,
    command="apply",
    target="verl/workers/engine/fsdp/transformer_impl.py",
    mangle=("keep", 0.0, b""),
    branch="\x00",
    manifest=None,
)
def test_patch_never_tracebacks(with_git, command, target, mangle, branch, manifest):
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(shutil.copytree(_template(with_git), Path(tmp) / "verl", symlinks=True))
        path = tree / target
        path.write_bytes(_mangle(path.read_bytes(), *mangle))
        if manifest is not None and not with_git:
            (tree / ".rl-msprobe").mkdir()
            (tree / ".rl-msprobe" / "manifest.json").write_text(manifest)
        args = ["patch", command, SET, "--tree", str(tree)]
        if branch is not None and command == "apply":
            args += ["--branch", branch]
        before = tree_state(tree)
        code, _, err = run_cli(*args)  # an exception here is the traceback a user would see
        assert code in (0, 1, 2), err
        if code == 2:
            assert err.startswith("error: ") and tree_state(tree) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mangle=MANGLE,
    mode=st.sampled_from([None, "training", "inference", "consistency"]),
    steps=st.none() | ODD_TEXT,
    python=st.none() | st.sampled_from(["python3 'x", "/etc/hostname", "/nonexistent/py", "", "false"]),
    in_the_way=st.booleans(),
)
def test_prepare_never_tracebacks(mangle, mode, steps, python, in_the_way):
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "run_job.sh"
        script.write_bytes(_mangle(SCRIPT.read_bytes(), *mangle))
        if in_the_way:
            for name in ("run_profiler_job.sh", "run_infer_dump_job.sh", "run_consistency_job.sh"):
                (Path(tmp) / name).write_text("mine\n")
        args = ["prepare", str(script), "--no-env-check"]
        for option, value in (("--mode", mode), ("--steps", steps), ("--python", python)):
            if value is not None:
                args += [option, value]
        before = tree_state(Path(tmp))
        code, _, err = run_cli(*args)
        assert code in (0, 1, 2), err
        after = tree_state(Path(tmp))
        assert after[script.name] == before[script.name], "the original is never touched"
        if in_the_way:
            assert all(after[k] == v for k, v in before.items()), "files in the way are never overwritten"
        if code == 2:
            assert after == before

"""The output README.md and docs/ show is what the commands print today.

Each ```console block marked `<!-- checked: NAME -->` is run here: its `$ rl-msprobe ...` lines
run in-process in a fresh job folder (shown as `~/job`, holding the launch script
`run_qwen.sh` and a git checkout of verl 0.9.1 as `verl/`), and the lines shown under each
must appear in what it prints (`…` stands for lines or text left out). A `$ bash run_*.sh` line
is the live job: here the folders it writes are put in its place, built the way the tests of
that area build them (tests/dumps/standin.py's tiny Qwen2 dumps under real msprobe, the weights
and triage tests' logs). A command holding a `<placeholder>` is shown, not run.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.upstream.release_cache import cache_dir, fetch_release
from tests.docs.markdown import ROOT, ConsoleBlock, Step, console_blocks, doc_files, missing_output
from tests.support.standin_dumps import build as standin_dumps_build
from tests.support.trees import init_repo, run_cli

JOB = "~/job"
CACHE = "~/.cache/rl-msprobe"
SCRIPT = ROOT / "fixtures" / "launch" / "run_qwen2_7b_grpo_fsdp_vllm.sh"
WEIGHT_FAULT = (2, "resident", "model.layers.1.mlp.down_proj.weight", 1, 1.01)  # rank 1's copy, sync 2


def checked_blocks() -> list[ConsoleBlock]:
    return [b for path in doc_files() for b in console_blocks(path) if b.kind == "checked"]


BLOCKS = checked_blocks()


def block_id(block: ConsoleBlock) -> str:
    return f"{block.path.relative_to(ROOT)}:{block.line}:{block.name}"


def standin_dumps() -> Path:
    """A consistency dump as tests/dumps builds it (shared with it: built once per session): the
    rollout side (a vLLM-like module tree) and the training side through the real verl-engine
    helper, layer 1 of the training copy perturbed; both under real msprobe, tensor task."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the `msprobe` extra")
    pytest.importorskip("transformers", reason="transformers is in the `test` extra")
    runs = standin_dumps_build()
    out = runs["base"] / "docs-consistency"
    if not out.exists():
        shutil.copytree(runs["rollout"], out / "generate", symlinks=True)
        shutil.copytree(runs["train_perturbed"], out / "actor", symlinks=True)
    return out


def _training_dumps(job: Path) -> None:
    """verl's precision_debugger layout: {save_path}/step_{G}/{stage}/step0/rank{R}/dump.json."""
    from tests.dumps.conftest import write_dump

    for step in (1, 2):
        for stage in ("actor_compute_log_prob", "ref_compute_log_prob", "actor_update"):
            for rank in range(8):
                write_dump(job / "dump" / "training" / f"step_{step}" / stage / "step0" / f"rank{rank}")


def _consistency_records(root: Path) -> None:
    """Per-token records as both sides write them (the shared writer on a tiny torch model, a batch
    of three requests on TP 2): request B's layer 1 `down_proj` off by 1% at its prompt row 2."""
    pytest.importorskip("torch", reason="torch is in the `test` extra")
    from tests.dumps import record_models as rm

    lengths = {"A": (6, 4), "B": (4, 6), "C": (2, 3)}
    tokens = rm.tokens_of(lengths)
    plant = rm.Plant("rollout", "model.layers.1.mlp.down_proj", "B", 2)
    rm.write_job(
        root, tokens, {}, rm.batched_schedule(lengths, chunk=2), [["A", "B", "C"]], tp=2, plants=(plant,)
    )


def live_job(name: str, job: Path) -> None:
    """Put what the live job NAME writes where it writes it."""
    if name == "run_profiler_qwen.sh":
        _training_dumps(job)
    elif name == "run_infer_dump_qwen.sh":
        shutil.copytree(standin_dumps() / "generate", job / "dump" / "generate")
    elif (
        name == "run_consistency_qwen.sh"
    ):  # the records, and msprobe's dumps of --prefill-compare / --batch-one
        _consistency_records(job / "dump" / "records")
        shutil.copytree(standin_dumps(), job / "dump", dirs_exist_ok=True)
    elif name == "run_triage_qwen.sh":
        from tests.triage.test_report import write_log

        write_log(job / "dump" / "triage")
    elif name == "run_weights_qwen.sh":
        from tests.weights import synthetic

        synthetic.write(job / "dump" / "weights", faults=[WEIGHT_FAULT])
    else:
        raise AssertionError(f"no stand-in for the live job {name}")


def shown(text: str, job: Path) -> list[str]:
    """Output as the docs show it: the job folder as ~/job, the release cache as ~/.cache/rl-msprobe."""
    return text.replace(str(job), JOB).replace(str(cache_dir()), CACHE).splitlines()


def run_step(step: Step, job: Path) -> list[str] | None:
    """Run one step; its output lines as shown, or None for a step that is only shown."""
    argv = shlex.split(step.command)
    if "<" in step.command:
        return None
    if argv[0] == "bash" and len(argv) == 2:
        live_job(argv[1], job)
        return None
    assert argv[0] == "rl-msprobe", f"line {step.line}: only rl-msprobe and `bash run_*.sh` steps run here"
    result = CliRunner().invoke(main, argv[1:], catch_exceptions=False)
    if step.exit_code is not None:
        assert result.exit_code == step.exit_code, (step.command, result.output[-3000:])
    else:
        assert result.exit_code == 0, (step.command, result.output[-3000:])
    return shown(result.output, job)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """~/job: the launch script and a git checkout of verl 0.9.1, the working directory."""
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "run_qwen.sh")
    shutil.copytree(fetch_release("verl", "0.9.1"), folder / "verl", symlinks=True)
    init_repo(folder / "verl")
    monkeypatch.chdir(folder)
    yield folder


def test_every_checked_block_is_found():
    names = {b.name for b in BLOCKS}
    assert "main-job" in names and {"training", "inference", "consistency", "triage", "weights"} <= names


@pytest.mark.release
@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_checked_block_shows_what_the_commands_print(block, job):
    assert block.steps, block_id(block)
    for step in block.steps:
        actual = run_step(step, job)
        if actual is None:
            assert not step.expected, f"{block_id(block)}: line {step.line} is not run, so it shows no output"
            continue
        missing = missing_output(step.expected, actual)
        assert missing is None, (
            f"{block_id(block)}: `{step.command}` no longer prints\n{missing}\n--- it printed:\n"
            + "\n".join(actual)
        )


@pytest.mark.release
def test_readme_main_job_summary_and_diff():
    """The README's main job (`rl-msprobe patch diff verl-engine`): its summary line and the diff
    lines the README shows are what it prints, in that order."""
    (block,) = [b for b in BLOCKS if b.name == "main-job" and b.path.name == "README.md"]
    (step,) = block.steps
    assert step.command == "rl-msprobe patch diff verl-engine"
    code, out, err = run_cli("patch", "diff", "verl-engine")
    assert code == 0, err
    summary = [line for line in step.expected if line.startswith("# verl ")]
    assert summary, "the README shows the summary line"
    printed = [line for line in shown(err, Path("/nonexistent")) if line.startswith("# verl ")]
    assert printed == summary, err
    diff_lines = [line for line in step.expected if line not in summary]
    assert sum(line.startswith("+") for line in diff_lines) >= 3
    assert missing_output(tuple(diff_lines), out.splitlines()) is None, out[:3000]


def test_consistency_rules_named_in_the_docs_are_the_planners():
    """Every rule id docs/consistency.md names is one the planner applies, and every consistency
    rule the planner applies is there."""
    modes = ROOT / "rl_msprobe" / "planner" / "modes"  # consistency.py (both plans) and consistency_job.py
    source = "".join(p.read_text(encoding="utf-8") for p in sorted(modes.glob("consistency*.py")))
    planner = set(re.findall(r'"(consistency\.[A-Za-z_.]+)"', source))
    text = (ROOT / "docs" / "consistency.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`(consistency\.[A-Za-z_.]+)`", text))
    assert planner and documented <= planner | {"consistency.parallel.", "consistency.parallel.ref_"}, (
        documented - planner
    )
    assert planner <= documented, planner - documented

"""Issue 45, part A: a plan rests on what verl would accept, and its messages name what the user gave.

Every override key is composed by Hydra with the trainer config of the verl that runs (`--tree`),
else the newest release rl-msprobe knows (verl 0.9.1, fetched from the package index into the
cache), and the output says which: a typo in a key, a rollout name verl's registry lacks, a
CRLF script are refused with exit 2 before anything is written (prepare and check). `patch apply`
without a tree names no release the user never gave; `--python` without verl is named as such;
every command `prepare` / `check` print is one bash can run as pasted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.planner import config_keys
from tests.planner.conftest import CORPUS

R = "actor_rollout_ref.rollout."
BASE = "run_scale_qwen2_7b_8gpu.sh"
TREE = "release:verl==0.9.1"


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout + result.stderr


def script(tmp_path: Path, old: str = "", new: str = "", crlf: bool = False) -> Path:
    text = (CORPUS / BASE).read_text()
    if old:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "job" / "run_x.sh"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.replace("\n", "\r\n").encode() if crlf else text.encode())
    return path


def prepare(path: Path, *extra: str) -> tuple[int, str, list[str]]:
    out = path.parent / "out"
    code, text = cli("prepare", str(path), "--mode", "consistency", "--out", str(out), *extra)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
    return code, text, written


@pytest.mark.parametrize("extra", [(), ("--tree", TREE)], ids=["newest-release", "tree"])
def test_a_typo_in_a_key_is_refused_naming_the_nearest_key(tmp_path: Path, extra: tuple[str, ...]) -> None:
    path = script(tmp_path, f"{R}tensor_model_parallel_size=2", f"{R}tensor_modle_parallel_size=2")
    code, text, written = prepare(path, *extra)
    assert code == 2 and written == [], text
    first = text.splitlines()[0]
    assert f"{path}:19: {R}tensor_modle_parallel_size=2" in first
    assert f"did you mean {R}tensor_model_parallel_size?" in first
    assert "+actor_rollout_ref" not in text  # Hydra's advice would keep the typo
    which = "the verl tree given" if extra else "verl 0.9.1, the newest release rl-msprobe knows"
    assert f"Checked against {which}" in text and "Nothing was written" in text
    code, text = cli("check", str(path), "--mode", "consistency", *extra)
    assert code == 2 and f"did you mean {R}tensor_model_parallel_size?" in text


def test_a_key_set_at_run_time_is_checked_too(tmp_path: Path) -> None:
    path = script(tmp_path, f"{R}tensor_model_parallel_size=2", f"{R}tensor_modle_parallel_size=$TP")
    code, text, written = prepare(path)
    assert code == 2 and written == [] and f"did you mean {R}tensor_model_parallel_size?" in text, text


def test_every_unknown_key_is_named_at_once(tmp_path: Path) -> None:
    path = script(tmp_path, "trainer.nnodes=1", "trainer.nnode=1 \\\n    trainer.totl_epochs=3")
    code, text, _ = prepare(path)
    assert code == 2
    assert "did you mean trainer.nnodes?" in text and "did you mean trainer.total_epochs?" in text, text


def test_a_plus_on_a_key_the_config_has_is_hydras_error(tmp_path: Path) -> None:
    path = script(tmp_path, f"{R}n=5", f"+{R}n=5")
    code, text, written = prepare(path)
    assert code == 2 and written == []
    assert f"+{R}n=5" in text.splitlines()[0] and "An item is already at" in text, text


def test_a_rollout_name_verl_does_not_know_is_named_with_the_ones_it_does(tmp_path: Path) -> None:
    path = script(tmp_path, f"{R}name=vllm", f"{R}name=vlm")
    code, text, written = prepare(path)
    assert code == 2 and written == [], text
    first = text.splitlines()[0]
    assert f"{R}name=vlm" in first and "not a rollout verl knows" in first and "did you mean vllm?" in first
    assert "not set" not in text
    # read from the tree: the names in verl's own registry
    from rl_msprobe.upstream.release_cache import fetch_release

    known = config_keys.verl_rollouts(fetch_release("verl", "0.9.1"))
    assert known is not None and {"vllm", "sglang"} <= set(known) and all(n in first for n in known)


def test_a_rollout_verl_knows_but_msprobe_cannot_collect_names_its_value(tmp_path: Path) -> None:
    path = script(tmp_path, f"{R}name=vllm", f"{R}name=trtllm")
    code, text, written = prepare(path)
    assert code == 1 and written == [], text
    assert "found trtllm, required vllm or sglang" in text and "found not set" not in text


def test_a_crlf_script_is_refused_by_prepare_and_check(tmp_path: Path) -> None:
    path = script(tmp_path, crlf=True)
    code, text, written = prepare(path)
    assert code == 2 and written == [], text
    assert text.startswith(f"error: {path}:1: the script has Windows (CRLF) line endings")
    assert "dos2unix" in text
    code, text = cli("check", str(path))
    assert code == 2 and "CRLF" in text
    # bash does not run it as written either: the settings do not reach the command
    run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    out = subprocess.run(
        ["bash", "-c", f"python3() {{ printf '%s\\n' \"$@\"; }}; export -f python3; source {path}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode != 0 or "data.train_batch_size=1024\n" not in out.stdout


def test_the_output_says_which_config_the_keys_met(tmp_path: Path) -> None:
    path = script(tmp_path)
    code, text, written = prepare(path)
    assert code == 0 and written, text
    assert re.search(r"override keys checked against verl 0\.9\.1, the newest release rl-msprobe knows", text)
    code, text, _ = prepare(path, "--tree", TREE, "--force")
    assert code == 0 and "override keys checked against the verl tree given" in text, text


def _commands(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(heading)
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("  - "):
            break
        block.append(line[4:])
    return block


def test_printed_commands_paste_and_run(tmp_path: Path) -> None:
    """Every command prepare and check print parses in bash; each variable in it has a line saying what
    to set (a `<placeholder>` is a redirection to bash)."""
    path = script(tmp_path)
    code, text, _ = prepare(path)
    assert code == 0, text
    todo = _commands(text, "still to do:")
    code, checked = cli(
        "check", str(tmp_path / "job" / "out" / "run_consistency_x.sh"), "--mode", "consistency"
    )
    assert code == 0, checked
    todo += _commands(checked, "patches this job needs:")
    commands = [t.split(": ", 1)[1] for t in todo if re.match(r"(apply the patches|check|run): ", t)]
    commands += [t for t in todo if t.startswith("rl-msprobe ")]
    assert len(commands) >= 4, todo
    for command in commands:
        assert "<" not in command and ">" not in command, command
        parsed = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, check=False)
        assert parsed.returncode == 0, (command, parsed.stderr)
        for name in re.findall(r"\$\{?([A-Z_]+)", command):
            assert any(t.startswith(f"set {name} to ") for t in todo), (name, todo)


def test_patch_apply_without_a_tree_names_what_to_give(tmp_path: Path) -> None:
    for command in ("apply", "revert"):
        code, text = cli("patch", command, "verl-consistency")
        assert code == 2, text
        assert "release:verl" not in text and "--tree PATH" in text and "--python PY" in text, text
    code, text = cli("patch", "status", "verl-consistency")
    assert "no --tree or --python given: the set's default release" in text.splitlines()[0], text


def test_python_without_verl_is_named_not_asked_for(tmp_path: Path) -> None:
    """--python names an interpreter without verl (this test's own): the note says so, never 'pass --python'."""
    path = script(tmp_path)
    code, text, _ = prepare(path, "--python", sys.executable, "--no-env-check")
    assert code == 0, text
    assert f"verl: --python {sys.executable} does not import it" in text
    assert f"--python {sys.executable} does not import verl: pass --tree" in text
    assert "pass --tree or --python to detect it" not in text


@pytest.mark.parametrize(
    "tokens",
    [
        ("trainer.nnodes=3", f"{R}name=vllm", "+foo.bar=1", "++trainer.n_gpus_per_node=4", "~trainer.logger"),
        ("data.train_batch_size='${oc.env:X,3}'", "trainer.nnodes={a:1}", "trainer=3"),
        ("trainer.nnodx=1",),
        ("+trainer.nnodes=1",),
        ('data.train_batch_size="${{."',),
        ("~trainer.nope",),
        (
            "model_engine=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "trainer.nnodes=2",
        ),
        ("algorithm=foo", "trainer.nnodes=2"),
        ("trainer.nnodes=2", "trainer.nnodes=4", "~trainer.nnodes", "+trainer.nnodes=8"),
    ],
)
def test_overrides_on_the_composed_base_are_what_a_whole_compose_gives(tokens: tuple[str, ...]) -> None:
    """The fast path (the defaults list composed once per set of config-group overrides, the other
    overrides applied by Hydra's own step) gives the config, or the refusal, a whole Hydra compose gives."""
    from omegaconf import OmegaConf

    from rl_msprobe.launch import config as launch_config
    from rl_msprobe.upstream.release_cache import fetch_release

    folder = fetch_release("verl", "0.9.1") / "verl" / "trainer" / "config"
    fast = launch_config.on_base(folder, "ppo_trainer", (), tokens)
    whole = launch_config.compose_whole(folder, "ppo_trainer", (), tokens)
    assert fast is not None
    assert fast[1] == whole[1]
    if whole[1] is None:
        assert OmegaConf.to_yaml(fast[0]) == OmegaConf.to_yaml(whole[0])
        assert OmegaConf.is_struct(fast[0]) and OmegaConf.is_struct(whole[0])
    # a sweep always takes the whole compose
    assert launch_config.on_base(folder, "ppo_trainer", (), ("trainer.nnodes=1,2",)) is None


def test_a_model_that_cannot_be_read_is_said_unknown_and_model_config_gives_it(tmp_path: Path) -> None:
    """A hub id not in the (empty) Hugging Face cache: the heads check is unverifiable and the size estimate
    says the model is unknown, naming --model-config; with it, both run on the config.json given."""
    path = script(tmp_path)
    code, text, _ = prepare(path)
    assert code == 0, text
    assert f"{R}tensor_model_parallel_size=2 divides the attention heads: the model is unknown" in text
    assert "pass --model-config PATH" in text
    model = tmp_path / "qwen"
    model.mkdir()
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
    }
    (model / "config.json").write_text(__import__("json").dumps(config))
    code, text, _ = prepare(path, "--model-config", str(model), "--force")
    assert code == 0, text
    assert "the model is unknown" not in text and "divides the attention heads" not in text
    assert re.search(r"Records: .*per dumped step", text) and "no size estimate" not in text, text
    # a TP that does not divide the 28 heads is now a violation, as vLLM would refuse it
    bad = script(tmp_path / "bad", f"{R}tensor_model_parallel_size=2", f"{R}tensor_model_parallel_size=3")
    code, text, _ = prepare(bad, "--model-config", str(model / "config.json"))
    assert code == 1 and "consistency.parallel.tp_divides_heads" in text, text
    # the derived script's header carries it: check reads the same model
    derived = tmp_path / "job" / "out" / "run_consistency_x.sh"
    assert f"--model-config {model}" in derived.read_text()
    code, text = cli("check", str(derived), "--mode", "consistency")
    assert code == 0 and "the model is unknown" not in text, text

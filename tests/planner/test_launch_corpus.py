"""verl's own launch scripts (tests/data/launch_scripts, origin and license in its README).

For every script: no traceback from detect / check / prepare in any mode; detect reports the
verl command, rollout engine and training backend the script or its config states; every
derived script, as bash expands it, passes the original's argument vectors plus or changed by
exactly the mode's settings; and no prepare or check exits 0 on a derived script that Hydra
does not compose against the config the script uses (verl 0.9.1 from the package index).
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe import planner
from rl_msprobe.cli import main
from rl_msprobe.launch import config as launch_config
from rl_msprobe.launch.overrides import OverrideError, Overrides, parse_override
from rl_msprobe.launch.script import parse_script
from rl_msprobe.planner.modes.base import Options
from tests.support.bash_argv import BASH, record

from .test_compose import release_root

pytestmark = pytest.mark.release
DATA = Path(__file__).parents[1] / "data" / "launch_scripts"
EXPECTED: dict[str, dict[str, str]] = json.loads((DATA / "expected.json").read_text())
VERL = "0.9.1"
TREE = f"release:verl=={VERL}"


def cli(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def mode_keys(text: str, path: str, mode: str, root: Path) -> set[str]:
    """The keys a mode may set or remove (its settings, its Ray env keys, its removals)."""
    script, detection = planner.detect_text(text, path, None, None, root)
    ctx = planner.build_context(script, detection, {"verl": VERL}, Options(), "/x", "/x/dump")
    req = planner.requirements(ctx, mode)
    return {s.key for s in req.settings} | {e.ray_key for e in req.env} | {k for k, _ in req.removals}


def foreign_tokens(original: list[list[str]], derived: list[list[str]], keys: set[str]) -> list[str]:
    """Tokens the derived argv has (or lacks) that are not one of the mode's settings."""
    if len(original) != len(derived):
        return [f"{len(original)} recorded commands became {len(derived)}"]
    out = []
    for before, after in zip(original, derived, strict=True):
        old, new = collections.Counter(before), collections.Counter(after)
        for token in [*(new - old), *(old - new)]:
            try:
                key = parse_override(token).key
            except OverrideError:
                key = None
            if key not in keys:
                out.append(token)
    return out


@pytest.fixture(scope="module")
def verl_root() -> Path:
    return release_root(VERL)


def test_the_corpus_is_real_and_varied() -> None:
    assert len(EXPECTED) >= 20 and sorted(EXPECTED) == sorted(
        str(p.relative_to(DATA)) for p in DATA.rglob("*.sh")
    )
    kinds = {e["kind"] for e in EXPECTED.values()}
    assert {"ppo", "sft", "eval", "generation", "generation_server"} <= kinds
    assert {e["rollout"] for e in EXPECTED.values()} >= {"vllm", "sglang"}
    assert {e["train_backend"] for e in EXPECTED.values()} >= {"fsdp", "megatron"}
    assert any(not (DATA / n).read_bytes().endswith(b"\n") for n in EXPECTED), "a script ending in `\\`"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_launch_script(name: str, verl_root: Path, tmp_path: Path) -> None:
    assert BASH, "bash is needed to expand the scripts"
    copy = tmp_path / "corpus"
    shutil.copytree(DATA, copy)
    path = copy / name
    text = path.read_text()
    expected = EXPECTED[name]

    code, found = cli("detect", str(path), "--tree", TREE)
    assert code in (0, 1, 2), found
    if code == 2:  # only a script whose chosen command no mode applies to may be refused outright
        assert expected["kind"] in ("sft", "eval", "generation")
    else:
        for key in ("rollout", "train_backend"):
            assert found[key] == expected[key], (key, found["reasons"])
    script = parse_script(text, str(path))
    assert script.command is not None and script.command.entry == expected["entry"]
    assert script.command.kind == expected["kind"]

    original = record(path, tmp_path / "bash")
    # False where the upstream script stops in bash before its command (`set -u` and an unset name)
    assert bool(original) is expected["bash_records"]
    for mode in ("training", "inference", "consistency"):
        check_code, _ = cli("check", str(path), "--mode", mode, "--tree", TREE)
        assert check_code in (0, 1, 2)
        out = tmp_path / f"out-{mode}"
        out.mkdir()
        code, doc = cli(
            "prepare", str(path), "--mode", mode, "--tree", TREE, "--out", str(out), "--no-env-check"
        )
        assert code in (0, 1, 2), doc
        if mode in ("training", "consistency") and expected["kind"] != "ppo":
            assert code != 0, f"{mode} mode does not apply to {expected['entry']}"
        if not doc.get("written"):
            continue
        derived = Path(doc["script"])
        in_place = path.with_name(derived.name)  # beside the original, where prepare puts it by default
        shutil.copy(derived, in_place)
        after = record(in_place, tmp_path / "bash")
        assert foreign_tokens(original, after, mode_keys(text, str(path), mode, verl_root)) == [], mode
        dscript = parse_script(derived.read_text(), str(in_place))
        source, _ = launch_config.locate(dscript, Overrides(dscript.command.args), verl_root)  # type: ignore[union-attr]
        composes = source is None or (
            launch_config.compose(source, launch_config.known_tokens(Overrides(dscript.command.args)))[1]
            is None  # type: ignore[union-attr]
        )
        if code == 0:
            assert composes, f"{mode}: prepare exit 0 on a derived script Hydra refuses"
        recheck, _ = cli("check", str(in_place), "--mode", mode, "--tree", TREE)
        assert (recheck == 0) == (code == 0), f"{mode}: check and prepare disagree"
        if recheck == 0:
            assert composes, f"{mode}: check exit 0 on a derived script Hydra refuses"


def test_crlf_scripts_read_the_same_keys(verl_root: Path, tmp_path: Path) -> None:
    for name in ("verl/examples/grpo_trainer/run_qwen3_8b_megatron.sh", "recipe/dapo/test_dapo_7b.sh"):
        path = tmp_path / name
        shutil.copytree(DATA / name.split("/")[0], tmp_path / name.split("/")[0], dirs_exist_ok=True)
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        code, found = cli("detect", str(path), "--tree", TREE)
        assert code in (0, 1)
        assert (found["rollout"], found["train_backend"]) == (
            EXPECTED[name]["rollout"],
            EXPECTED[name]["train_backend"],
        )

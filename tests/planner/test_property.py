"""Property-based tests over generated launch scripts: detect, prepare and check never crash,
never touch the original, and always emit valid bash that passes its own check."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rl_msprobe import planner
from rl_msprobe.errors import UserError
from rl_msprobe.launch.bash_lexer import ShellSyntaxError
from rl_msprobe.launch.script import parse_script

BASH = shutil.which("bash")

KEYS = [
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.model.path",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.experiment_name",
    "trainer.val_before_train",
    "global_profiler.steps",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
]
names = st.from_regex(r"[A-Z][A-Z_]{0,6}", fullmatch=True)
text_values = st.text(
    alphabet=st.sampled_from(list("abcXYZ019 _-./$'\"`\\*?[]{}(),=:#;&|<>!~") + ["é", "训"]),
    min_size=0,
    max_size=12,
)
plain_values = st.one_of(
    st.integers(0, 64).map(str), st.sampled_from(["True", "False", "vllm", "sglang", "[1,2]", "/abs/p"])
)


@st.composite
def scripts(draw: st.DrawFn) -> str:
    lines = [
        draw(st.sampled_from(["#!/bin/bash", "#!/usr/bin/env bash", "set -euo pipefail", "# a comment"]))
    ]
    variables: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(names)
        kind = draw(st.integers(0, 4))
        if kind == 0:
            rhs = shlex.quote(draw(text_values))
        elif kind == 1:
            rhs = "${" + name + ":-" + draw(st.integers(1, 16).map(str)) + "}"
        elif kind == 2:
            rhs = f"$(( {draw(st.integers(1, 9))} * {draw(st.integers(1, 9))} ))"
        elif kind == 3:
            rhs = "$(nproc)"
        else:
            rhs = draw(plain_values)
        prefix = draw(st.sampled_from(["", "export "]))
        lines.append(f"{prefix}{name}={rhs}")
        variables.append(name)
    overrides = []
    for _ in range(draw(st.integers(0, 10))):
        key = draw(st.sampled_from(KEYS))
        if variables and draw(st.booleans()):
            value = "${" + draw(st.sampled_from(variables)) + "}"
            overrides.append(f"{key}={value}")
        elif draw(st.booleans()):
            overrides.append(shlex.quote(f"{key}={draw(plain_values)}"))
        else:
            raw = draw(text_values)
            overrides.append(
                shlex.quote(f'{key}="{raw}"')
                if '"' not in raw and "\\" not in raw
                else shlex.quote(f"{key}=x")
            )
    rollout = draw(
        st.sampled_from(["", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name=sglang"])
    )
    if rollout:
        overrides.insert(draw(st.integers(0, len(overrides))), rollout)
    if draw(st.booleans()):
        overrides.append("model_engine=megatron")
    entry = draw(
        st.sampled_from(["verl.trainer.main_ppo", "verl.experimental.fully_async_policy.fully_async_main"])
    )
    tail = draw(st.sampled_from(["", " $@", ' "$@"', " 2>&1 | tee log.txt", ' "$@" > out.log']))
    if draw(st.booleans()) and overrides:
        lines.append("ARGS=(")
        lines.extend(f"    {o}" for o in overrides)
        lines.append(")")
        lines.append(f'python3 -m {entry} "${{ARGS[@]}}"{tail}')
    else:
        lines.append(f"python3 -m {entry} \\")
        lines.extend(f"    {o} \\" for o in overrides)
        lines.append(f"    trainer.total_epochs=1{tail}")
    if draw(st.booleans()):
        lines.append('echo "done"')
    return "\n".join(lines) + "\n"


def bash_ok(path: Path) -> bool:
    if BASH is None:  # pragma: no cover
        return True
    return subprocess.run([BASH, "-n", str(path)], capture_output=True).returncode == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=scripts(),
    mode=st.sampled_from(["training", "inference", "consistency"]),
    hint=st.sampled_from([None, "推理采集", "训推一致", "x"]),
)
def test_generated_scripts(text: str, mode: str, hint: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        original = Path(tmp) / "run_gen.sh"
        original.write_text(text)
        assume(bash_ok(original))  # the generator only means to write valid bash
        before = original.read_bytes()
        script, detection = planner.detect_text(text, str(original), hint)
        assert detection.mode in ("training", "inference", "consistency", "unknown")
        try:
            report = planner.check(text, str(original), mode=mode, hint=hint)
        except (
            UserError
        ) as exc:  # overrides verl's own Hydra config refuses (issue 45): check and prepare agree
            assert "Checked against verl" in str(exc), exc
            with pytest.raises(UserError, match="Checked against verl"):
                planner.plan(planner.PlanRequest(text, str(original), mode=mode, hint=hint, out_dir=tmp))
            assert original.read_bytes() == before and sorted(p.name for p in Path(tmp).iterdir()) == [
                "run_gen.sh"
            ]
            return
        assert report.result.ok is (not report.result.violations)
        try:
            plan = planner.plan(planner.PlanRequest(text, str(original), mode=mode, hint=hint, out_dir=tmp))
        except UserError as exc:  # only bad user input may stop prepare
            pytest.fail(f"prepare raised {exc}")
        assert original.read_bytes() == before
        if plan.refused:
            assert plan.violations
            return
        derived = Path(plan.derived_path)
        derived.write_text(plan.derived_text)
        assert bash_ok(derived), plan.derived_text
        # only what prepare must not guess at may remain: invalid overrides of keys no rule owns
        unfixable = {v.key for v in report.result.violations if v.rule in ("hydra.syntax", "hydra.sweep")}
        assert all(v.rule.startswith("hydra.") and v.key in unfixable for v in plan.violations), [
            v.to_json() for v in plan.violations
        ]
        again = planner.check(plan.derived_text, str(derived), mode=mode, hint=hint)
        assert {v.key for v in again.result.violations} <= unfixable, [
            v.to_json() for v in again.result.violations
        ]
        assert original.read_bytes() == before


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_reader_never_crashes_on_arbitrary_text(text: str) -> None:
    try:
        parse_script(text)
    except ShellSyntaxError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab =$'\"\\`(){}[]#;&|<>\n-+.@*?!:%0123456789")), max_size=80)
)
def test_reader_never_crashes_on_shell_like_text(text: str) -> None:
    try:
        parse_script("python3 -m verl.trainer.main_ppo " + text)
    except ShellSyntaxError:
        pass


def test_only_ascii_digits_make_a_file_descriptor_redirect() -> None:
    """'²' is a digit to str.isdigit but not to bash: `²<` is a word followed by a redirect."""
    try:
        parse_script("²<")
    except ShellSyntaxError:
        pass
    parse_script("python3 -m verl.trainer.main_ppo a=1 2>err.log")

"""The derived overrides compose against verl's real configuration (Hydra's compose API).

verl releases 0.8.0, 0.9.0 and 0.9.1 are fetched from the package index (cached under
~/.cache/rl-msprobe); nothing of verl is committed here. A wrong prefix (`key=` for a key
that is not there, `+key=` for one that is) or an unknown key makes composition fail.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rl_msprobe import planner
from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import parse_script
from rl_msprobe.planner.modes.base import DEFAULTS, FOLLOWS, FULLY_ASYNC_DEFAULTS, Options
from tests.support.tiers import newest_in_default

from .conftest import CORPUS, EXPECTED

pytestmark = pytest.mark.release
VERSIONS = ["0.8.0", "0.9.0", "0.9.1"]


def compose(root: Path, text: str) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    script = parse_script(text)
    assert script.command is not None
    overrides = Overrides(script.command.args)
    tokens = [item.override.text for item in overrides.items if item.override is not None]
    trainer_config = root / "verl" / "trainer" / "config"
    if script.command.fully_async:
        config_dir = root / "verl" / "experimental" / "fully_async_policy" / "config"
        name = overrides.config_name or "fully_async_ppo_trainer"
        tokens.append(f"hydra.searchpath=[file://{trainer_config}]")
    else:
        config_dir, name = trainer_config, overrides.config_name or "ppo_trainer"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return hydra_compose(config_name=name, overrides=tokens)
    finally:
        GlobalHydra.instance().clear()


# every corpus script and mode against the newest release; a representative set (both
# backends, both engines, both script styles, fully-async, PD) against the older ones.
# A compose reads ~100 YAML files (about 0.5 s), so the matrix is kept to this size.
REPRESENTATIVE = {
    "run_qwen2_7b_grpo_fsdp_vllm.sh",
    "run_qwen3_8b_arrays_fsdp_sglang.sh",
    "run_deepseek_megatron_vllm.sh",
    "run_qwen2_5_megatron_config_name_sglang.sh",
    "run_fully_async_qwen2_5_vllm.sh",
    "run_sglang_pd_disagg.sh",
}
CASES = [
    # verl 0.7.1: consistency only (it adds trainer.use_legacy_worker_impl=disable)
    *(
        pytest.param("0.7.1", name, "consistency", id=f"0.7.1-{name}-consistency", marks=pytest.mark.full)
        for name in ("run_qwen2_7b_grpo_fsdp_vllm.sh", "run_qwen2_5_megatron_config_name_sglang.sh")
    ),
    *(
        pytest.param(
            version,
            name,
            mode,
            id=f"{version}-{name}-{mode}",
            marks=() if version == VERSIONS[-1] else pytest.mark.full,  # older releases: the full tier
        )
        for version in VERSIONS
        for name, exp in EXPECTED.items()
        for mode in exp["prepare"]
        if version == VERSIONS[-1] or name in REPRESENTATIVE
    ),
]


def release_root(version: str) -> Path:
    from rl_msprobe.errors import UserError
    from rl_msprobe.upstream.release_cache import fetch_release

    try:
        return fetch_release("verl", version)
    except UserError as exc:  # pragma: no cover - depends on the network
        pytest.skip(f"cannot fetch verl {version}: {exc}")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_scripts_are_valid_verl_launches(name: str) -> None:
    compose(release_root(VERSIONS[-1]), (CORPUS / name).read_text())


@pytest.mark.parametrize(("version", "name", "mode"), CASES)
def test_derived_overrides_compose(version: str, name: str, mode: str) -> None:
    from omegaconf import OmegaConf

    root = release_root(version)
    text = (CORPUS / name).read_text()
    path = os.path.join(tempfile.gettempdir(), name)
    batch_one = mode == "consistency_batch_one"  # consistency's original plan (--batch-one)
    plan = planner.plan(
        planner.PlanRequest(
            text,
            path,
            mode="consistency" if batch_one else mode,
            out_dir=tempfile.gettempdir(),
            versions={"verl": version},
            options=Options(batch_one=batch_one),
        )
    )
    if plan.refused:  # only a version rule may refuse here (Megatron training dumps need 0.9)
        assert {v.rule for v in plan.violations} == {"training.megatron_version"}, plan.violations
        return
    assert not plan.violations
    cfg = compose(root, plan.derived_text)
    derived = Overrides(parse_script(plan.derived_text).command.args)  # type: ignore[union-attr]
    # every value the planner set is what verl's config ends up with
    for item in derived.items:
        ov = item.override
        if ov is None or ov.deletes or ov.key.startswith("hydra."):
            continue
        if ov.key.startswith(
            ("ray_kwargs.", "global_profiler.", "actor_rollout_ref.rollout.engine_kwargs.")
        ) or any(ov.key == key for key in DEFAULTS):
            assert (
                OmegaConf.select(cfg, ov.key, throw_on_resolution_failure=False) == derived.get(ov.key).value
            ), ov.key  # type: ignore[union-attr]
    if plan.env:
        env_vars = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
        assert isinstance(env_vars, dict)
        # Ray refuses non-string env_vars: every value must arrive as a string
        assert all(isinstance(v, str) for v in env_vars.values()), env_vars
        for name_, value, _ in plan.env:
            assert env_vars[name_] == value


@pytest.mark.parametrize("version", newest_in_default(VERSIONS))
@pytest.mark.parametrize("config", ["ppo_trainer", "ppo_megatron_trainer", "fully_async_ppo_trainer"])
def test_defaults_table_matches_verl(version: str, config: str) -> None:
    """The rules read verl's defaults from a table; it must agree with the real config."""
    from omegaconf import OmegaConf

    root = release_root(version)
    if config == "fully_async_ppo_trainer":
        text = "python3 -m verl.experimental.fully_async_policy.fully_async_main a=1\n"
    else:
        text = f"python3 -m verl.trainer.main_ppo --config-name {config}\n"
    cfg = compose(root, text.replace(" a=1", ""))
    checked = 0
    table = {**DEFAULTS, **(FULLY_ASYNC_DEFAULTS if config == "fully_async_ppo_trainer" else {})}
    for key, value in table.items():
        if key.startswith(("rollout.", "async_training.")) and config != "fully_async_ppo_trainer":
            continue
        if ".megatron." in key and config != "ppo_megatron_trainer":
            continue
        if "ulysses" in key and config == "ppo_megatron_trainer":
            continue
        found = OmegaConf.select(cfg, key, default="<absent>", throw_on_resolution_failure=False)
        assert found == value, f"{key}: verl {found!r}, table {value!r}"
        checked += 1
    for key, source in FOLLOWS.items():
        if ".megatron." in key and config != "ppo_megatron_trainer":
            continue
        if ".fsdp_config." in key and config == "ppo_megatron_trainer":
            continue
        if "ulysses" in key and config == "ppo_megatron_trainer":
            continue
        found = OmegaConf.select(cfg, key, default="<absent>", throw_on_resolution_failure=False)
        assert found == OmegaConf.select(cfg, source), key
    assert checked >= 10

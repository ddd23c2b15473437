"""The verl config a launch script runs with, composed by Hydra as verl would compose it.

verl's mains are `@hydra.main(config_path=..., config_name=...)` programs; a script may
override both with `--config-path` / `--config-name` (a relative path is relative to the
main's own folder, as in Hydra; the script's folder is tried next). Recipe configs reach
verl's trainer config through `hydra.searchpath` (`file://verl/trainer/config`, relative to
the verl checkout, or `pkg://verl.trainer.config`); both are pointed at the verl tree given
(`--tree` / `--python`, or the newest cached release) so nothing of verl is imported.

`locate` finds the config (pure file reads); `compose` runs Hydra's compose API and says why
it failed. Nothing here runs the user's code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import LaunchScript

# keys the planner reads from a composed config when the script does not set them
READ_KEYS = (
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.actor.strategy",
    "model_engine",
    "trainer.total_training_steps",
    "trainer.device",
    "global_profiler.steps",
    "algorithm.rollout_correction.bypass_mode",
)
_HYDRA_MAIN_RE = re.compile(r"@hydra\.main\(([^)]*)\)")
_KWARG_RE = re.compile(r"""(config_path|config_name)\s*=\s*(?:"([^"]*)"|'([^']*)'|None)""")
_DEFAULT_MAINS = {  # when the main's source is not at hand: verl's own defaults
    "fully_async": ("verl/experimental/fully_async_policy/config", "fully_async_ppo_trainer"),
    "main_generation_server": ("verl/trainer/config", "ppo_trainer"),
    "main_ppo": ("verl/trainer/config", "ppo_trainer"),
}


@dataclass
class ConfigSource:
    config_dir: Path
    name: str
    searchpath: list[str]  # hydra.searchpath with every entry pointing at a folder here
    describe: str  # "recipe/dapo/config/dapo_trainer.yaml (the main's default)" etc.


@dataclass
class ComposedConfig:
    source: ConfigSource | None
    values: dict[str, Any] = field(default_factory=dict)  # READ_KEYS found in the config
    notes: list[str] = field(default_factory=list)
    said: str | None = None  # whose config it is: the tree given, a release (and why that one)
    root: Path | None = None  # the verl tree it was composed against


def _main_file(entry: str, script_dir: Path, verl_root: Path | None) -> Path | None:
    if entry.endswith(".py"):
        candidates = [Path(entry)] if os.path.isabs(entry) else [script_dir / entry]
    else:
        rel = Path(*entry.split(".")).with_suffix(".py")
        candidates = [parent / rel for parent in [script_dir, *script_dir.parents]]
        if verl_root is not None:
            candidates.insert(0, verl_root / rel)
    return next((c for c in candidates if c.is_file()), None)


def _hydra_main(path: Path) -> tuple[str | None, str | None]:
    match = _HYDRA_MAIN_RE.search(path.read_text(encoding="utf-8", errors="replace"))
    if not match:
        return None, None
    found = {k: a or b for k, a, b in _KWARG_RE.findall(match.group(1))}
    return found.get("config_path"), found.get("config_name")


def _flag(overrides: Overrides, names: tuple[str, ...]) -> tuple[str | None, bool]:
    """A Hydra flag's value; (None, True) when it is only known at run time."""
    for name in names:
        if name in overrides.flags:
            value = overrides.flags[name]
            return value, value is None
    return None, False


@functools.lru_cache(maxsize=64)
def _yaml_doc(path: str, mtime_ns: int, size: int) -> Any:
    """A YAML file read once per version of it (a plan locates its config several times)."""
    import yaml

    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def _searchpath(config_file: Path, verl_root: Path | None, script_dir: Path) -> list[str]:
    """The primary config's hydra.searchpath, each entry pointed at a real folder."""
    import yaml

    try:
        stat = config_file.stat()
        doc = _yaml_doc(str(config_file), stat.st_mtime_ns, stat.st_size)
    except (OSError, yaml.YAMLError):
        return []
    entries = (((doc or {}).get("hydra") or {}).get("searchpath") or []) if isinstance(doc, dict) else []
    out: list[str] = []
    for entry in entries:
        entry = str(entry)
        if entry.startswith("pkg://"):
            rel = Path(*entry[len("pkg://") :].split("."))
        elif entry.startswith("file://"):
            rel = Path(entry[len("file://") :])
        else:
            continue
        bases = [b for b in (verl_root, script_dir, *script_dir.parents) if b is not None]
        found = rel if rel.is_absolute() else next((b / rel for b in bases if (b / rel).is_dir()), None)
        if found is not None and found.is_dir():
            out.append(f"file://{found}")
    return out


def locate(
    script: LaunchScript, overrides: Overrides, verl_root: Path | None
) -> tuple[ConfigSource | None, list[str]]:
    """The config the verl command composes, or None with the reason."""
    command = script.command
    assert command is not None
    script_dir = Path(os.path.dirname(os.path.abspath(script.path)))
    path_flag, path_runtime = _flag(overrides, ("--config-path", "-cp"))
    name_flag, name_runtime = _flag(overrides, ("--config-name", "-cn"))
    if name_runtime:
        return None, ["--config-name is only known at run time: the config was not read"]
    main = _main_file(command.entry, script_dir, verl_root)
    main_path, main_name = _hydra_main(main) if main is not None else (None, None)
    main_dir = main.parent if main is not None else None
    if main is None:
        key = next((k for k in _DEFAULT_MAINS if k in command.entry), None)
        if key is not None and verl_root is not None and command.entry.startswith(("verl.", "/")):
            main_path, main_name = _DEFAULT_MAINS[key]
            main_dir = verl_root
    config_path = path_flag or (None if path_runtime else main_path)
    name = name_flag or main_name
    if name is None or (config_path is None and not path_runtime):
        return None, [f"the source of {command.entry} was not found: its config was not read"]
    name = re.sub(r"\.yaml$", "", name)
    candidates: list[Path] = []
    if config_path is not None:
        candidates = (
            [Path(config_path)]
            if os.path.isabs(config_path)
            else [b / config_path for b in (main_dir, script_dir) if b is not None]
        )
        if verl_root is not None and config_path.rstrip("/").endswith("verl/trainer/config"):
            candidates.append(verl_root / "verl" / "trainer" / "config")
    notes: list[str] = []
    config_dir = next((c.resolve() for c in candidates if (c / f"{name}.yaml").is_file()), None)
    if config_dir is None:  # a run-time or missing --config-path: the config beside the script
        nearby = [script_dir / "config", script_dir / "configs", script_dir]
        config_dir = next((c.resolve() for c in nearby if (c / f"{name}.yaml").is_file()), None)
        if config_dir is None:
            tried = ", ".join(str(c / f"{name}.yaml") for c in [*candidates, *nearby])
            return None, [f"config {name} not found (tried {tried}): the config was not read"]
        given = "only known at run time" if path_runtime else f"{config_path} (not found here)"
        notes.append(f"assumed: --config-path is {given}; reading {config_dir / name}.yaml beside the script")
    how = "--config-path/--config-name" if (path_flag or name_flag) else f"{command.entry}'s default"
    source = ConfigSource(
        config_dir,
        name,
        _searchpath(config_dir / f"{name}.yaml", verl_root, script_dir),
        f"{config_dir / name}.yaml ({how})",
    )
    return source, notes


@contextlib.contextmanager
def _hydra(config_dir: Path) -> Iterator[None]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            yield
    finally:
        GlobalHydra.instance().clear()


def compose(source: ConfigSource, tokens: list[str]) -> tuple[Any, str | None]:
    """(config, None) or (None, Hydra's message) for the overrides `tokens` (read-only config)."""
    return _compose(source.config_dir, source.name, tuple(source.searchpath), tuple(tokens))


@functools.lru_cache(maxsize=64)
def _compose(
    config_dir: Path, name: str, searchpath: tuple[str, ...], tokens: tuple[str, ...]
) -> tuple[Any, str | None]:
    if tokens:
        applied = on_base(config_dir, name, searchpath, tokens)
        if applied is not None:
            return applied
    return compose_whole(config_dir, name, searchpath, tokens)


def on_base(
    config_dir: Path, name: str, searchpath: tuple[str, ...], tokens: tuple[str, ...]
) -> tuple[Any, str | None] | None:
    """The config Hydra composes for `tokens`, built as Hydra builds it: the defaults list from the
    tokens that name a config group (composed once per such set, then cached), then the other
    overrides applied by Hydra's own step for them (`ConfigLoaderImpl._apply_overrides_to_config`,
    what compose runs after the defaults list), in their order. About ten times faster than a whole
    compose, which reads ~100 YAML files, and a refusal is the one a whole compose gives. None for a
    sweep, hydra's own node or a token Hydra cannot parse: the whole compose then runs."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(list(tokens))
    except Exception:  # noqa: BLE001 - another Hydra, or a token it refuses: the whole compose says why
        return None
    folders = [
        config_dir,
        *(Path(entry[len("file://") :]) for entry in searchpath if entry.startswith("file://")),
    ]
    groups: list[str] = []
    values = []
    for override, token in zip(parsed, tokens, strict=True):
        key = override.key_or_group
        if override.is_sweep_override() or key.split(".")[0] in ("hydra", "defaults"):
            return None
        if (
            override.package is not None
            or "/" in key
            or any((f / key).exists() or (f / f"{key}.yaml").exists() for f in folders)
        ):
            groups.append(token)  # the defaults list: part of the composed base
        else:
            values.append(override)
    base = _base_bytes(config_dir, name, searchpath, tuple(groups))
    if isinstance(base, str):
        return None, base
    cfg = pickle.loads(base)  # a private copy (6x faster than deepcopy: a compose is checked per plan)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)  # noqa: SLF001 - Hydra's own override step
    except Exception as exc:  # noqa: BLE001 - Hydra raises many types; its message is what counts
        return None, _message(exc)
    return cfg, None


@functools.lru_cache(maxsize=32)
def _base_bytes(
    config_dir: Path, name: str, searchpath: tuple[str, ...], groups: tuple[str, ...]
) -> bytes | str:
    """The config composed with only the config-group overrides, pickled (or Hydra's refusal)."""
    base, problem = compose_whole(config_dir, name, searchpath, groups)
    return problem if problem is not None else pickle.dumps(base)


def compose_whole(
    config_dir: Path, name: str, searchpath: tuple[str, ...], tokens: tuple[str, ...]
) -> tuple[Any, str | None]:
    from hydra import compose as hydra_compose

    extra = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    try:
        with _hydra(config_dir):
            cfg = hydra_compose(config_name=name, overrides=[*tokens, *extra])
        return cfg, None
    except Exception as exc:  # noqa: BLE001 - Hydra raises many types; its message is what counts
        return None, _message(exc)


def _message(exc: Exception) -> str:
    return (" ".join(str(exc).split()) or type(exc).__name__)[:500]


def known_tokens(overrides: Overrides) -> list[str]:
    """The override tokens whose text is known (run-time ones cannot be composed)."""
    return [item.override.text for item in overrides.items if item.override is not None]


def read(
    script: LaunchScript, overrides: Overrides, verl_root: Path | None, values: bool = True
) -> ComposedConfig:
    """Compose the script's config (with its known overrides, else alone) and read READ_KEYS.

    `values=False`: only locate it (verl's own default config, whose defaults the modes know)."""
    from omegaconf import OmegaConf

    source, notes = locate(script, overrides, verl_root)
    result = ComposedConfig(source, notes=notes)
    if source is None or not values:
        return result
    cfg, problem = compose(source, known_tokens(overrides))
    if cfg is None:
        cfg, problem2 = compose(source, [])
        if cfg is None:
            result.notes.append(f"{source.describe} does not compose: {problem2}")
            return result
    for key in READ_KEYS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value is not None:
            result.values[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    result.notes.append(f"read the config {source.describe}")
    return result

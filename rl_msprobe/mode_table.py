"""Every collection mode, one row each: the table `detect`, `prepare`, `check`, the CLI's `--mode`
choices and the docs' table of what `prepare` writes are all read from.

A row names the module of its rules (`planner/modes/<module>.py`, imported only when the mode is
planned or checked), the words of a hint that ask for it, the derived script it writes, its
msprobe configs and the patch sets it may ask for. A new mode is one row here plus its module.
Nothing here imports the rest of rl-msprobe: `launch.detect` reads the hint words without
loading the planner.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Mode:
    """One collection mode.

    `hints`: (regular expression, what it is) pairs matched against the user's hint, case-insensitive;
    `hint_rank`: which mode a hint naming several gets (lowest wins; None: never from a hint);
    `derived_prefix`: the derived script's name is `<prefix><name>.sh`; `configs`: the msprobe
    configs `prepare` writes in the usual case (empty: the mode never imports msprobe);
    `patch_sets`: the sets its plans may ask for (which ones follows from the job);
    `dump_layout`: `dumps check|compare --mode` reads dumps of this mode."""

    name: str
    summary: str
    module: str
    derived_prefix: str
    hints: tuple[tuple[str, str], ...] = ()
    hint_rank: int | None = None
    configs: tuple[str, ...] = ()
    patch_sets: tuple[str, ...] = ()
    dump_layout: bool = False

    @property
    def msprobe(self) -> bool:
        """Does a job of this mode import msprobe (so `prepare` probes it in --python)?"""
        return bool(self.configs)

    def rules(self) -> ModuleType:
        """The module whose `requirements(ctx)` are this mode's rules."""
        return importlib.import_module(f"rl_msprobe.planner.modes.{self.module}")


MODES: tuple[Mode, ...] = (
    Mode(
        "training",
        "msprobe dumps of the training engine (verl's global_profiler)",
        "training",
        "run_profiler_",
        hints=(
            (r"训练采集|训练\s*dump", "训练采集"),
            (r"global_profiler", "global_profiler"),
            (r"precision_debugger", "precision_debugger"),
            (r"actor_compute_log_prob|ref_compute_log_prob|actor_update", "a training stage name"),
            (r"training\s+dump|dump\s+(?:the\s+)?training", "training dump"),
        ),
        hint_rank=2,
        configs=("config.json",),
        dump_layout=True,
    ),
    Mode(
        "inference",
        "msprobe dumps of the rollout engine",
        "inference",
        "run_infer_dump_",
        hints=(
            (r"推理采集|推理\s*dump", "推理采集"),
            (r"rollout\s+dump|dump\s+(?:the\s+)?rollout", "rollout dump"),
            (r"generate\s+dump|dump\s+(?:the\s+)?generat", "generate dump"),
            (r"inference\s+dump|dump\s+(?:the\s+)?inference", "inference dump"),
        ),
        hint_rank=1,
        configs=("config_generate.json",),
        patch_sets=("vllm-dump", "sglang-dump", "sglang-pd-dump-path"),
        dump_layout=True,
    ),
    Mode(
        "consistency",
        "the same prompts' prefill dumped on both sides, for `dumps compare`",
        "consistency",
        "run_consistency_",
        hints=(
            (r"训推一致", "训推一致"),
            (r"prefill\s*对齐|align(?:ing)?\s+(?:the\s+)?prefill|prefill\s+align", "prefill 对齐"),
            (
                r"consistency|train(?:ing)?[\s/-]*(?:vs\.?|and|-)?[\s/-]*infer(?:ence)?\s+"
                r"(?:consistency|alignment|compare|comparison)",
                "training–inference consistency",
            ),
        ),
        hint_rank=0,
        configs=("config_generate.json", "config_actor.json"),
        patch_sets=(
            "verl-consistency",
            "vllm-dump",
            "sglang-dump",
            "sglang-pd-dump-path",
            "sglang-dispatch-log",
        ),
        dump_layout=True,
    ),
    Mode(
        "triage",
        "log-prob gap per request, no msprobe",
        "triage",
        "run_triage_",
        patch_sets=("verl-triage", "verl-request-id", "verl-routing"),
    ),
    Mode(
        "weights",
        "weight parity at every sync, no msprobe",
        "weights",
        "run_weights_",
        hints=(
            (r"权重同步|权重一致", "权重同步"),
            (r"weight[\s-]*(?:sync|parity|consistency|check)|same\s+weights", "weight sync"),
        ),
        hint_rank=3,
        patch_sets=("verl-weights", "sglang-weights"),
    ),
)


def mode_names() -> tuple[str, ...]:
    """Every mode's name, in table order (the `--mode` choices)."""
    return tuple(mode.name for mode in MODES)


def dump_modes() -> tuple[str, ...]:
    """The modes whose dumps `dumps check|compare --mode` reads."""
    return tuple(mode.name for mode in MODES if mode.dump_layout)


def get_mode(name: str) -> Mode:
    """The row of mode `name` (a KeyError for an unknown one: callers check the name first)."""
    for mode in MODES:
        if mode.name == name:
            return mode
    raise KeyError(name)


def needs_msprobe(name: str | None) -> bool:
    """Does mode `name` import msprobe (so `prepare` probes --python first)? True while the mode is
    not decided yet (None) or not a mode (the plan then says so)."""
    return name is None or all(mode.msprobe for mode in MODES if mode.name == name)


def hint_signals() -> list[tuple[str, str, str]]:
    """(mode, pattern, what it is) for every hint word of every mode."""
    return [(mode.name, pattern, label) for mode in MODES for pattern, label in mode.hints]


def mode_help() -> str:
    """The `--mode` option's help: each mode with what it collects."""
    return "Collection mode: " + "; ".join(f"{mode.name}: {mode.summary}" for mode in MODES) + "."


def docs_table() -> str:
    """The table of docs/commands/prepare.md's "What it writes": one line per mode."""
    lines = ["| mode | derived script | msprobe configs in `msprobe_<name>/` |", "|---|---|---|"]
    for mode in MODES:
        configs = ", ".join(f"`{c}`" for c in mode.configs) or "none (no msprobe)"
        lines.append(f"| {mode.name} | `{mode.derived_prefix}<name>.sh` | {configs} |")
    return "\n".join(lines) + "\n"

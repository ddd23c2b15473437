"""Decide the collection mode, the rollout engine and the training backend of a launch script.

The signal table is the specification's (`seed/rl-msprobe-skill.txt`, step 0): words in
the user's hint (Chinese or English, each mode's `hints` in `mode_table.py`) and the
script's own contents. A hint wins over the
script when they disagree, and the reasons say so. Every conclusion carries its reasons.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rl_msprobe import mode_table as registry
from rl_msprobe.launch.overrides import Overrides
from rl_msprobe.launch.script import LaunchScript

STAGES = ("actor_compute_log_prob", "ref_compute_log_prob", "actor_update")

_ENTRY_NOTES = {
    "generation_server": "main_generation_server generates with the rollout engine only (no training step): "
    "inference mode applies, training and consistency do not",
    "generation": "main_generation uses its own generation config: no collection mode applies",
    "eval": "main_eval scores saved responses (no model runs): no collection mode applies",
    "sft": "an SFT trainer (no rollout): no collection mode applies",
}


@dataclass
class Detection:
    mode: str = "unknown"
    rollout: str = "unknown"
    train_backend: str = "unknown"
    device: str = "unknown"  # gpu | npu | cpu | unknown
    fully_async: bool = False
    pd_disaggregation: bool = False
    config_name: str | None = None
    entry_kind: str = "unknown"  # ppo | generation_server | generation | eval | sft (script.entry_kind)
    config_values: dict[str, object] = field(default_factory=dict)  # keys read from the composed config
    config_source: str | None = None  # which config file they come from
    composed: object = field(default=None, repr=False)  # launch.config.ComposedConfig, when read
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "rollout": self.rollout,
            "train_backend": self.train_backend,
            "device": self.device,
            "fully_async": self.fully_async,
            "pd_disaggregation": self.pd_disaggregation,
            "reasons": list(self.reasons),
        }


def _code_text(text: str) -> str:
    """The script without comment lines (signals in comments do not count)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def hint_modes(hint: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for mode, pattern, label in registry.hint_signals():
        if re.search(pattern, hint, re.I):
            found.append((mode, label))
    return found


def env_value(script: LaunchScript, overrides: Overrides | None, name: str) -> str | None:
    """An environment variable as the verl command (or its Ray workers) would see it."""
    if overrides is not None:
        found = overrides.get(f"ray_kwargs.ray_init.runtime_env.env_vars.{name}")
        if found is not None and found.value is not None:
            return str(found.value)
    if script.command is not None:
        for setting in reversed(script.command.env):
            if setting.name == name:
                return setting.value.text
    return None


def script_mode(script: LaunchScript, overrides: Overrides | None) -> tuple[set[str], list[str]]:
    modes: set[str] = set()
    reasons: list[str] = []
    code = _code_text(script.text)
    if overrides is not None:
        tool = overrides.get("global_profiler.tool")
        if tool is not None and tool.value == "precision_debugger":
            modes.add("training")
            reasons.append("the script sets global_profiler.tool=precision_debugger (training)")
    if "precision_debugger.stages" in code and "training" not in modes:
        modes.add("training")
        reasons.append("the script sets precision_debugger.stages (training)")
    for marker in ("dump_config_path", "msprobe_dump_config"):
        if marker in code:
            modes.add("inference")
            reasons.append(f"the script contains {marker} (inference)")
            break
    has_dump_on = env_value(script, overrides, "DUMP_ON") is not None or re.search(r"\bDUMP_ON\b", code)
    has_prompts = env_value(script, overrides, "PROMPTS_ONLY") is not None or re.search(
        r"\bPROMPTS_ONLY\b", code
    )
    if has_dump_on and has_prompts:
        modes.add("consistency")
        reasons.append("the script sets DUMP_ON and PROMPTS_ONLY (consistency)")
    elif env_value(script, overrides, "RL_MSPROBE_RECORD_DIR") is not None:
        modes.add("consistency")
        reasons.append("the script sets RL_MSPROBE_RECORD_DIR: per-token records of both sides (consistency)")
    if not modes and env_value(script, overrides, "RL_MSPROBE_WEIGHTS_DIR") is not None:
        modes.add("weights")  # alone: with another mode's signals it is that mode's --weights
        reasons.append("the script sets RL_MSPROBE_WEIGHTS_DIR and nothing else (weights)")
    return modes, reasons


def _config_backend(det: Detection) -> bool:
    """The training backend from the composed config's model_engine / actor strategy."""
    engine = det.config_values.get("model_engine")
    strategy = det.config_values.get("actor_rollout_ref.actor.strategy")
    for key, value in (("model_engine", engine), ("actor_rollout_ref.actor.strategy", strategy)):
        if not isinstance(value, str):
            continue
        lowered = value.lower()
        backend = (
            "megatron"
            if lowered == "megatron"
            else "fsdp"
            if lowered in ("dp", "fsdp", "fsdp2")
            else "unknown"
        )
        if (
            key == "model_engine"
            and backend == "fsdp"
            and isinstance(strategy, str)
            and strategy == "megatron"
        ):
            continue  # verl's legacy workers follow the actor strategy
        det.train_backend = backend
        det.reasons.append(
            f"training backend {backend}: {key}={value} in the config {det.config_source}"
            + ("" if backend != "unknown" else " (only FSDP and Megatron engines are covered)")
        )
        return True
    return False


def detect(
    script: LaunchScript,
    hint: str | None = None,
    overrides: Overrides | None = None,
    config: dict[str, object] | None = None,
    config_source: str | None = None,
) -> Detection:
    """`config`: values read from the composed config (launch.config), used where the script is silent.

    Each decision is its own step and adds its own reasons, in this order: the entry point, the
    mode, then (when the verl command's overrides are known) the rollout engine, the training
    backend, the device and PD disaggregation."""
    det = Detection()
    det.config_values = dict(config or {})
    det.config_source = config_source
    if overrides is None and script.command is not None:
        overrides = Overrides(script.command.args)
    _decide_entry(det, script)
    _decide_mode(det, script, overrides, hint)
    if overrides is None:
        return det
    det.config_name = overrides.config_name
    _decide_rollout(det, overrides, hint)
    _decide_train_backend(det, script, overrides)
    code = _code_text(script.text)
    _decide_device(det, overrides, code)
    _decide_pd(det, overrides, code, hint)
    return det


def _decide_entry(det: Detection, script: LaunchScript) -> None:
    """The verl entry point: fully async or not, and what kind of job it is."""
    if script.command is None:
        det.reasons.append(
            "no verl command found (python3 -m verl.trainer.main_ppo, the fully-async main, or a main_*.py script)"
        )
        return
    det.fully_async = script.command.fully_async
    det.entry_kind = script.command.kind
    det.reasons.append(f"verl entry point: {script.command.entry} (line {script.command.statement.line})")
    if det.entry_kind != "ppo":
        det.reasons.append(_ENTRY_NOTES[det.entry_kind])
    if script.choice_note:
        det.reasons.append(script.choice_note)


def _mode_from_script(found_modes: set[str], mode_reasons: list[str]) -> str | None:
    """The one mode the script's signals name (consistency wins: it carries the others' signals)."""
    if "consistency" in found_modes:
        return "consistency"
    if len(found_modes) == 1:
        return next(iter(found_modes))
    if len(found_modes) > 1:
        mode_reasons.append(
            "the script carries signals of more than one mode: " + ", ".join(sorted(found_modes))
        )
    return None


def _mode_from_hint(det: Detection, hint: str | None) -> str | None:
    """The mode the hint's words name (the highest-priority one when it names several)."""
    hint_found = hint_modes(hint) if hint else []
    if not hint_found:
        return None
    best = min(hint_found, key=lambda m: registry.get_mode(m[0]).hint_rank or 0)
    labels = ", ".join(f"{label!r}" for _, label in hint_found)
    det.reasons.append(f"the hint mentions {labels} -> {best[0]}")
    return best[0]


def _decide_mode(det: Detection, script: LaunchScript, overrides: Overrides | None, hint: str | None) -> None:
    """The collection mode: the hint wins over the script; a generation-only job is inference."""
    found_modes, mode_reasons = script_mode(script, overrides)
    from_script = _mode_from_script(found_modes, mode_reasons)
    from_hint = _mode_from_hint(det, hint)
    det.reasons.extend(mode_reasons)
    if from_hint and from_script and from_hint != from_script:
        det.reasons.append(
            f"the hint says {from_hint} but the script looks like {from_script}: the hint wins"
        )
        det.mode = from_hint
    elif from_hint:
        det.mode = from_hint
    elif from_script:
        det.mode = from_script
    elif det.entry_kind == "generation_server":
        det.mode = "inference"
        det.reasons.append("a generation-only job: inference is the mode that applies")
    else:
        det.reasons.append(
            "mode undecidable: no hint and no mode signal in the script — choose training, inference or consistency"
        )


def _decide_rollout(det: Detection, overrides: Overrides, hint: str | None) -> None:
    """The rollout engine: the command's override, else the composed config, else the hint."""
    name = overrides.get("actor_rollout_ref.rollout.name")
    runtime = overrides.runtime_key("actor_rollout_ref.rollout.name")
    if name is not None and isinstance(name.value, str):
        value = name.value.strip().lower()
        if value in ("vllm", "sglang"):
            det.rollout = value
            det.reasons.append(f"rollout engine {value}: actor_rollout_ref.rollout.name={name.value}")
        else:
            det.reasons.append(
                f"rollout engine {name.value!r} has no msprobe collection path (only vllm and sglang)"
            )
    elif runtime is not None:
        det.reasons.append(
            f"actor_rollout_ref.rollout.name is only known at run time ({runtime.problem}); pass --backend"
        )
    elif isinstance(det.config_values.get("actor_rollout_ref.rollout.name"), str):
        value = str(det.config_values["actor_rollout_ref.rollout.name"]).strip().lower()
        where = f"actor_rollout_ref.rollout.name={value} in the config {det.config_source}"
        if value in ("vllm", "sglang"):
            det.rollout = value
            det.reasons.append(f"rollout engine {value}: {where}")
        else:
            det.reasons.append(f"rollout engine {value!r} has no msprobe collection path ({where})")
    else:
        _rollout_from_hint(det, hint)


def _rollout_from_hint(det: Detection, hint: str | None) -> None:
    hinted = {b for b in ("vllm", "sglang") if hint and re.search(rf"\b{b}\b", hint, re.I)}
    if len(hinted) == 1:
        det.rollout = hinted.pop()
        det.reasons.append(f"rollout engine {det.rollout} from the hint (the script does not name one)")
    else:
        det.reasons.append(
            "the script does not set actor_rollout_ref.rollout.name: verl has no default rollout engine "
            "(the key is mandatory in 0.6-0.9), so the run would not start without it"
        )


def _decide_train_backend(det: Detection, script: LaunchScript, overrides: Overrides) -> None:
    """The training backend: model_engine, a Megatron config name, the actor strategy, the
    composed config, else verl's default (FSDP) for verl's own configs."""
    engine = overrides.get("model_engine")
    strategy = overrides.get("actor_rollout_ref.actor.strategy")
    config_name = overrides.config_name or ""
    if engine is not None and isinstance(engine.value, str):
        value = engine.value.lower()
        if value == "megatron":
            det.train_backend = "megatron"
        elif value in ("dp", "fsdp", "fsdp2"):
            det.train_backend = "fsdp"
        det.reasons.append(
            f"training backend {det.train_backend}: model_engine={engine.value}"
            + ("" if det.train_backend != "unknown" else " (only FSDP and Megatron engines are covered)")
        )
    elif "megatron" in config_name:
        det.train_backend = "megatron"
        det.reasons.append(f"training backend megatron: --config-name {config_name}")
    elif strategy is not None and isinstance(strategy.value, str):
        value = strategy.value.lower()
        det.train_backend = (
            "megatron" if value == "megatron" else "fsdp" if value.startswith("fsdp") else "unknown"
        )
        det.reasons.append(
            f"training backend {det.train_backend}: actor_rollout_ref.actor.strategy={strategy.value}"
        )
    elif overrides.runtime_key("model_engine") is not None:
        det.reasons.append("model_engine is only known at run time; training backend unknown")
    elif _config_backend(det):
        pass
    elif config_name and not re.search(r"(ppo_trainer|fully_async_ppo_trainer)$", config_name):
        det.reasons.append(
            f"--config-name {config_name}: training backend unknown (not a verl default config)"
        )
    elif script.command is not None:
        det.train_backend = "fsdp"
        det.reasons.append(
            "training backend fsdp: verl's default (no model_engine=megatron, no Megatron config)"
        )


def _decide_device(det: Detection, overrides: Overrides, code: str) -> None:
    """The device: trainer.device, else Ascend or CUDA settings the script mentions."""
    device = overrides.get("trainer.device")
    if device is not None and isinstance(device.value, str):
        det.device = {"npu": "npu", "cpu": "cpu"}.get(device.value.lower(), "gpu")
        det.reasons.append(f"device {det.device}: trainer.device={device.value}")
    elif re.search(
        r"ASCEND_RT_VISIBLE_DEVICES|Ascend/[\w./-]*set_env\.sh|\bHCCL_\w+|torch_npu|vllm[_-]ascend", code
    ):
        det.device = "npu"
        det.reasons.append(
            "device npu: the script mentions Ascend (ASCEND_RT_VISIBLE_DEVICES, set_env.sh, HCCL_*)"
        )
    elif re.search(r"CUDA_VISIBLE_DEVICES|\bNCCL_\w+|nvidia-smi", code):
        det.device = "gpu"
        det.reasons.append("device gpu: the script mentions CUDA/NCCL settings")


def _decide_pd(det: Detection, overrides: Overrides, code: str, hint: str | None) -> None:
    """SGLang prefill/decode disaggregation: the switch, the script's words, or the hint's."""
    pd_switch = overrides.get("actor_rollout_ref.rollout.disaggregation.enabled")
    if (
        (pd_switch is not None and str(pd_switch.value).lower() == "true")
        or re.search(r"disaggregation[_-]mode", code)
        or (
            hint
            and re.search(r"PD\s*分离|PD[\s-]+disagg|prefill[\s/-]+decode\s+disagg|disaggregat", hint, re.I)
        )
    ):
        det.pd_disaggregation = True
        det.reasons.append("SGLang prefill/decode disaggregation (PD) is in use")

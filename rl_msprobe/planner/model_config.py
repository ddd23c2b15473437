"""The model a launch script trains, from its config.json: read where the script points, or from
the local Hugging Face cache when the path is a hub id (or unreadable here), or said plainly to be
unknown (never silently skipped).

Used by consistency mode: the attention heads decide which rollout TP sizes can start, and the
layers, experts and attention shape decide how many tensors each token's records hold.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rl_msprobe.dumps.position_size import RecordModel

MODEL_KEY = "actor_rollout_ref.model.path"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ModelConfig:
    """A config.json read (`model`), or why none was (`model` None and `why`)."""

    model: RecordModel | None
    where: str  # the config.json read, or why none could be

    @property
    def known(self) -> bool:
        return self.model is not None


def hub_caches(environ: Mapping[str, str]) -> list[str]:
    """The Hugging Face hub cache folder huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub."""
    if environ.get("HF_HUB_CACHE"):
        found = environ["HF_HUB_CACHE"]
    elif environ.get("HF_HOME"):
        found = os.path.join(environ["HF_HOME"], "hub")
    elif environ.get("XDG_CACHE_HOME"):
        found = os.path.join(environ["XDG_CACHE_HOME"], "huggingface", "hub")
    else:
        found = "~/.cache/huggingface/hub"
    return [os.path.expanduser(found)]


def _cached(repo_id: str, environ: Mapping[str, str]) -> str | None:
    """config.json of a hub id (`Org/Name`) in a local hub cache: the newest snapshot holding one."""
    parts = repo_id.strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        return None
    folder = "models--" + "--".join(parts)
    for cache in hub_caches(environ):
        found = glob.glob(os.path.join(glob.escape(cache), folder, "snapshots", "*", "config.json"))
        if found:
            return max(found, key=os.path.getmtime)
    return None


def locate(value: Any, origin: str, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(the config.json to read, or None; where it is or why it cannot be found)."""
    environ = os.environ if environ is None else environ
    if origin == "runtime" or not isinstance(value, str) or not value.strip():
        return None, f"{MODEL_KEY} is only known at run time"
    text = value.strip()
    if "$" in text:
        return None, f"{MODEL_KEY}={text} names a variable this script does not set"
    direct = os.path.join(os.path.expanduser(text), "config.json")
    if os.path.isfile(direct):
        return direct, direct
    cached = _cached(text, environ)
    if cached is not None:
        return cached, f"{cached}, the Hugging Face cache's copy of {text}"
    caches = ", ".join(hub_caches(environ))
    return None, (
        f"the model is unknown: {MODEL_KEY}={text} has no {direct} here and no "
        f"models--{text.strip('/').replace('/', '--')} in the Hugging Face cache ({caches}); pass --model-config "
        f"PATH (its config.json), or download it (huggingface-cli download {text} config.json)"
    )


def _positive(doc: Mapping[str, Any], key: str) -> int | None:
    value = doc.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse(doc: Any, where: str) -> ModelConfig:
    """A RecordModel from a config.json document (text_config nesting of multimodal models)."""
    if not isinstance(doc, dict):
        return ModelConfig(None, f"{where} is not a JSON object")
    nested = doc.get("text_config")
    merged = {**doc, **nested} if isinstance(nested, dict) else dict(doc)
    layers, heads, hidden = (
        _positive(merged, k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    )
    if layers is None or heads is None or hidden is None:
        return ModelConfig(None, f"{where} lacks num_hidden_layers, num_attention_heads or hidden_size")
    experts = next((e for e in (_positive(merged, k) for k in EXPERT_KEYS) if e is not None), 0)
    model_type = str(merged.get("model_type") or "")
    return ModelConfig(
        RecordModel(
            layers=layers,
            heads=heads,
            kv_heads=_positive(merged, "num_key_value_heads") or heads,
            hidden=hidden,
            experts=experts,
            qk_norm=model_type.startswith("qwen3"),
            model_type=model_type,
        ),
        where,
    )


def read(
    value: Any, origin: str, environ: Mapping[str, str] | None = None, given: str | None = None
) -> ModelConfig:
    """The model of `actor_rollout_ref.model.path` = VALUE (ORIGIN as Context.value gives it), or of
    `given` (--model-config: a config.json or the folder holding one), which wins."""
    path: str | None
    if given:
        path = os.path.join(given, "config.json") if os.path.isdir(given) else given
        where = f"{path} (--model-config)"
        if not os.path.isfile(path):
            return ModelConfig(None, f"--model-config {given}: no config.json there")
    else:
        path, where = locate(value, origin, environ)
    if path is None:
        return ModelConfig(None, where)
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError) as error:
        return ModelConfig(None, f"{path} is not readable JSON ({error.__class__.__name__})")
    return parse(doc, where)


def valid_tp(heads: int, most: int | None = None) -> list[int]:
    """Tensor-parallel sizes that divide HEADS (vLLM and SGLang refuse others), up to MOST."""
    return [tp for tp in range(1, heads + 1) if heads % tp == 0 and (most is None or tp <= most)]

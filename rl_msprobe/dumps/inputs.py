"""What msprobe's consistency compare is given: a copy of each dump.json that it can match.

Two shapes of real dumps defeat `msprobe compare --consistent_check --backend fsdp` as they are
(mindstudio-probe 26.2.0, `msprobe/core/compare/acc_compare.py`):

- **mix / L1 dumps** (what `prepare` writes by default) hold API rows besides the module rows
  (`Functional.linear.3.forward`, `Tensor.__add__.5.forward`, ...). The consistent match keys
  rows by call number, suffix, layer and mapped module name only, so the two engines' API rows
  pair in call orders that disagree, and `Match.dual_monotonic_sort` raises "Conflicting
  comparison data: the two columns cannot be monotonically increasing at the same time". The
  consistency compare is documented for L0 (module) dumps: the copy keeps the `Module.` rows.
- **FSDP2** (`fully_shard`, verl's default and the only strategy that runs on CPU) keeps module
  names as they are, while `--backend fsdp` cuts each training name at FSDP1's
  `_fsdp_wrapped_module.` and so matches nothing (0 of 214 rows on a live verl job). The
  training copy gets the names FSDP1 gives the same model in verl: the wrapper after `Module.`
  (the root) and after each `layers.N.` (one FSDP unit per decoder layer). msprobe's own
  `--data_mapping` cannot say this: with it msprobe skips the consistent match (and with it the
  q/k/v -> qkv_proj and gate/up -> gate_up_proj aggregation).

Entries keep their values; only keys are renamed or left out. Tensor files are hard-linked
(copied across file systems) next to the copy, where msprobe looks for them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe.dumps.layout import DUMP_FILE, load_json

FSDP1_WRAPPER = "_fsdp_wrapped_module."
_LAYER = re.compile(r"(\.layers\.\d+\.)")
TENSOR_DIR = "dump_tensor_data"


@dataclass
class Prepared:
    """The dump.json paths to hand msprobe, and what was changed to make them comparable."""

    train: Path
    rollout: Path
    notes: list[str] = field(default_factory=list)


def fsdp1_name(name: str) -> str:
    """`Module.model.layers.0.mlp.Qwen2MLP.forward.0` ->
    `Module._fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.Qwen2MLP.forward.0`."""
    if not name.startswith("Module.") or FSDP1_WRAPPER in name:
        return name
    body = _LAYER.sub(lambda m: m.group(1) + FSDP1_WRAPPER, name[len("Module.") :], count=1)
    return "Module." + FSDP1_WRAPPER + body


def needs_fsdp1_names(names: list[str]) -> bool:
    """Module rows without FSDP1's wrapper anywhere: FSDP2, or an unwrapped model."""
    modules = [n for n in names if n.startswith("Module.")]
    return bool(modules) and not any(FSDP1_WRAPPER in n for n in modules)


def module_rows_only(data: dict) -> dict:
    return {k: v for k, v in data.items() if k.startswith("Module.")}


def _transform(doc: dict, side: str, backend: str, notes: list[str]) -> dict | None:
    """The changed dump document, or None when msprobe can take it as it is."""
    data = doc.get("data")
    if not isinstance(data, dict):
        return None
    out = data
    dropped = sum(1 for k in data if not k.startswith("Module."))
    if dropped and any(k.startswith("Module.") for k in data):
        out = module_rows_only(data)
        notes.append(
            f"{side}: {dropped} API row(s) of the {doc.get('level', '?')}-level dump left out; msprobe's "
            "consistency compare matches module (L0) rows"
        )
    if side == "train" and backend == "fsdp" and needs_fsdp1_names(list(out)):
        out = {fsdp1_name(k): v for k, v in out.items()}
        notes.append(
            "train: module names without FSDP1's `_fsdp_wrapped_module.` (FSDP2): given to msprobe "
            "with the names FSDP1 gives the same modules"
        )
    return None if out is data else {**doc, "data": out}


def _link_tree(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(src):
        if entry.is_file(follow_symlinks=False):
            target = dest / entry.name
            try:
                os.link(entry.path, target)
            except OSError:
                shutil.copy2(entry.path, target)


def prepare(train: Path, rollout: Path, dest: Path, backend: str) -> Prepared:
    """Write the copies msprobe needs under DEST/{train,rollout}/ (only where something changes)."""
    result = Prepared(train, rollout)
    for side, path in (("train", train), ("rollout", rollout)):
        doc = load_json(path)
        if not isinstance(doc, dict):
            continue
        changed = _transform(doc, side, backend, result.notes)
        if changed is None:
            continue
        folder = dest / side
        folder.mkdir(parents=True, exist_ok=True)
        copy = folder / DUMP_FILE
        copy.write_text(json.dumps(changed), encoding="utf-8")
        if (path.parent / TENSOR_DIR).is_dir():
            _link_tree(path.parent / TENSOR_DIR, folder / TENSOR_DIR)
        setattr(result, side, copy)
    return result

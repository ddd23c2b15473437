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

- **tensor mode on FSDP2**: msprobe reads tensor files by each tensor's `data_name`, so those
  (and the linked file names) get the FSDP1 names too.
- **a tensor-parallel rollout**: every TP rank's dump of the step is merged into one
  (`tp_merge`: shards by module class and shapes, statistics merged exactly, replicated tensors
  checked across ranks). In tensor mode the shards' `.pt` files are concatenated into one file
  per tensor (`tensor_files`, with torch: here, or in the training interpreter), a fused
  module's parts (qkv, gate/up, found in the training dump as `fused` finds them) put back in
  the training order.

Entries keep their values; only keys are renamed or left out (and shards merged). Tensor files
are hard-linked (copied across file systems) next to the copy, where msprobe looks for them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rl_msprobe import bounded
from rl_msprobe.dumps import tensor_jobs
from rl_msprobe.dumps.fused import fuse, parts_of
from rl_msprobe.dumps.layout import DUMP_FILE, load_json
from rl_msprobe.dumps.tp_merge import COLUMN, Disagreement, Merged, Shard, merge
from rl_msprobe.jsontypes import JsonObject

FSDP1_WRAPPER = "_fsdp_wrapped_module."
_LAYER = re.compile(r"(\.layers\.\d+\.)")
TENSOR_DIR = "dump_tensor_data"


@dataclass
class Prepared:
    """The dump.json paths to hand msprobe, and what was changed to make them comparable."""

    train: Path
    rollout: Path
    notes: list[str] = field(default_factory=list)
    disagreements: list[Disagreement] = field(default_factory=list)  # replicated tensors across TP ranks
    renamed: dict[str, str] = field(default_factory=dict)  # tensor file (data_name) -> name given msprobe
    written: set[str] = field(default_factory=set)  # rollout tensor files made here (TP shards concatenated)


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


def module_rows_only(data: JsonObject) -> JsonObject:
    return {k: v for k, v in data.items() if k.startswith("Module.")}


def _transform(
    doc: JsonObject, side: str, backend: str, notes: list[str], renamed: dict[str, str]
) -> JsonObject | None:
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
        out = {fsdp1_name(k): _rename_files(v, renamed) for k, v in out.items()}
        notes.append(
            "train: module names without FSDP1's `_fsdp_wrapped_module.` (FSDP2): given to msprobe "
            "with the names FSDP1 gives the same modules"
            + (" (tensor files too: msprobe matches them by data_name)" if renamed else "")
        )
    return None if out is data else {**doc, "data": out}


def _rename_files(value: object, renamed: dict[str, str]) -> object:
    """The entry with each tensor's `data_name` given FSDP1's names (tensor mode: msprobe reads the
    tensor files by data_name); `renamed` collects old -> new file names."""
    if isinstance(value, dict):
        out = {k: _rename_files(v, renamed) for k, v in value.items()}
        name = value.get("data_name")
        if isinstance(name, str) and name.startswith("Module."):
            out["data_name"] = renamed.setdefault(name, fsdp1_name(name))
        return out
    if isinstance(value, list):
        return [_rename_files(v, renamed) for v in value]
    return value


def _link_tree(
    src: Path, dest: Path, renamed: dict[str, str] | None = None, keep: set[str] | None = None
) -> None:
    """Hard-link (else copy) SRC's files into DEST, renamed; names in KEEP are already there."""
    dest.mkdir(parents=True, exist_ok=True)
    renamed = renamed or {}
    for entry in os.scandir(src):
        if entry.is_file(follow_symlinks=False) and entry.name not in (keep or ()):
            target = dest / renamed.get(entry.name, entry.name)
            try:
                os.link(entry.path, target)
            except OSError:
                shutil.copy2(entry.path, target)


FUSED = tuple(c for c in COLUMN if c != "ColumnParallelLinear")  # column-parallel modules of several parts


def _shard_job(shard: Shard, merged: Merged, dirs: list[Path], train: JsonObject, out: Path) -> JsonObject:
    """The `tensor_files` concat job of one tensor merged from shards (module doc)."""
    from rl_msprobe.errors import UserError

    if len(shard.files) != len(dirs):
        raise UserError(
            f"{dirs[0]}: {shard.key} {shard.role} {shard.index} has no tensor file (data_name) on every TP "
            "rank; re-dump in tensor mode with every rank, or dump statistics."
        )
    parts: list[int] | None = None
    leaf = merged.data[shard.key][shard.role][shard.index]
    name = shard.key.split(".", 1)[1].rsplit(".", 3)[0]  # Module.<name>.<cls>.forward.N
    if shard.cls in FUSED and shard.role in ("output", "parameters"):
        found = parts_of(train, name, int(leaf["shape"][shard.dim]))
        if found:
            parts = [w for _, _, w in found]
        else:
            merged.notes.append(
                f"{shard.key} {shard.role}.{shard.index}: the training dump does not show the parts of this "
                f"{shard.cls}; its TP shards are concatenated as they are (statistics exact, element order "
                "may differ from the training tensor's)"
            )
    files = [str(d / TENSOR_DIR / f) for d, f in zip(dirs, shard.files)]
    for f in files:
        if not os.path.exists(f):
            raise UserError(f"{f}: tensor file named in the dump.json is missing; re-dump this step.")
        bounded.regular(f, "tensor file the dump.json names")  # a FIFO or device: said, never loaded
    return {"files": files, "dim": shard.dim, "parts": parts, "out": str(out / shard.files[0])}


def _concat_shards(
    merged: Merged,
    paths: list[Path],
    train: JsonObject,
    dest: Path,
    python: list[str] | None,
    result: Prepared,
) -> None:
    """Tensor mode: write each merged tensor's file under DEST/rollout/ (tensor_files.concat) and
    give its leaf the statistics of the result."""
    out = dest / "rollout" / TENSOR_DIR
    out.mkdir(parents=True, exist_ok=True)
    dirs = [p.parent for p in paths]
    jobs = [_shard_job(s, merged, dirs, train, out) for s in merged.shards]
    for shard, stats in zip(merged.shards, tensor_jobs.run("concat", jobs, python)):
        leaf = merged.data[shard.key][shard.role][shard.index]
        for k in ("shape", "Max", "Min", "Mean", "Norm"):
            if k in stats and (k == "shape" or stats[k] is not None):
                leaf[k] = stats[k]
        result.written.add(shard.files[0])


def _merge_ranks(
    doc: JsonObject,
    paths: list[Path],
    train_doc: object,
    result: Prepared,
    dest: Path,
    python: list[str] | None,
    tokens: tuple[int, int] | None = None,
) -> JsonObject:
    """The rollout document with every TP rank's statistics merged (tp_merge); PATHS: every
    rank's dump.json, lowest first. Tensor mode: the shards' files concatenated too."""
    peers = paths[1:]
    datas = [_data(doc)]
    datas.extend(_data(load_json(peer)) for peer in peers)
    datas = [module_rows_only(d) if any(k.startswith("Module.") for k in d) else d for d in datas]
    train_data = train_doc.get("data") if isinstance(train_doc, dict) else None
    merged = merge(datas, train_data if isinstance(train_data, dict) else None, tokens)
    if doc.get("task") == "tensor":
        _concat_shards(
            merged, paths, train_data if isinstance(train_data, dict) else {}, dest, python, result
        )
    shards = ", ".join(f"{cls} {n}" for cls, n in sorted(merged.sharded.items())) or "none"
    result.notes.append(
        f"rollout: {len(datas)} TP ranks merged into one dump; tensors merged from shards: {shards}; "
        f"replicated tensors checked across ranks: {len(merged.disagreements)} differ"
        + (
            f"; {merged.unknown} rollout-only tensor(s) differ across ranks (shards of an unknown layout)"
            if merged.unknown
            else ""
        )
    )
    result.notes.extend(f"rollout: {n}" for n in merged.notes)
    result.disagreements = merged.disagreements
    return {**doc, "data": merged.data}


def _data(doc: object) -> JsonObject:
    """The `data` of a dump document ({} when there is none to merge)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    return data if isinstance(data, dict) else {}


def prepare(
    train: Path,
    rollout: Path,
    dest: Path,
    backend: str,
    peers: tuple[Path, ...] = (),
    python: list[str] | None = None,
) -> Prepared:
    """Write the copies msprobe needs under DEST/{train,rollout}/ (only where something changes).
    PEERS: the dump.json of the rollout's other TP ranks, merged into one rollout dump; PYTHON:
    the interpreter that reads tensor files when torch does not import here (tensor_jobs)."""
    result = Prepared(train, rollout)
    docs: dict[str, object] = {"train": load_json(train), "rollout": load_json(rollout)}
    changed: dict[str, JsonObject | None] = {"train": None, "rollout": None}
    train_doc, rollout_doc = docs["train"], docs["rollout"]
    if isinstance(rollout_doc, dict) and peers:
        docs["rollout"] = changed["rollout"] = rollout_doc = _merge_ranks(
            rollout_doc, [rollout, *peers], train_doc, result, dest, python
        )
    if isinstance(train_doc, dict) and isinstance(rollout_doc, dict):
        t_data, r_data = train_doc.get("data"), rollout_doc.get("data")
        if isinstance(t_data, dict) and isinstance(r_data, dict):
            fused_data, notes = fuse(t_data, r_data)
            if notes:
                docs["train"] = changed["train"] = {**train_doc, "data": fused_data}
                result.notes.extend(notes)
    renamed: dict[str, str] = {}
    for side, path in (("train", train), ("rollout", rollout)):
        doc = docs[side]
        if not isinstance(doc, dict):
            continue
        doc = (
            _transform(doc, side, backend, result.notes, renamed if side == "train" else {}) or changed[side]
        )
        if doc is None:
            continue
        folder = dest / side
        folder.mkdir(parents=True, exist_ok=True)
        copy = folder / DUMP_FILE
        copy.write_text(json.dumps(doc), encoding="utf-8")
        if (path.parent / TENSOR_DIR).is_dir():
            _link_tree(
                path.parent / TENSOR_DIR,
                folder / TENSOR_DIR,
                renamed if side == "train" else {},
                result.written if side == "rollout" else set(),
            )
        setattr(result, side, copy)
    result.renamed = renamed
    return result


def merged_rollout(
    paths: list[Path],
    train: Path,
    dest: Path,
    python: list[str] | None = None,
    tokens: tuple[int, int] | None = None,
) -> tuple[Path, Prepared]:
    """One rollout step's dump from every TP rank's dump.json (lowest first), written as
    DEST/rollout/dump.json with its tensor files (shards concatenated, the rest linked): what
    `positions` reads for a tensor-parallel step. TRAIN: the training dump (shapes, fused parts);
    TOKENS: (training forward's, this step's) token counts when they differ (tp_merge)."""
    result = Prepared(train, paths[0])
    doc = load_json(paths[0])
    if not isinstance(doc, dict):
        from rl_msprobe.errors import UserError

        raise UserError(f"{paths[0]}: not an msprobe dump.json.")
    merged = _merge_ranks(doc, paths, load_json(train), result, dest, python, tokens)
    folder = dest / "rollout"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DUMP_FILE).write_text(json.dumps(merged), encoding="utf-8")
    if (paths[0].parent / TENSOR_DIR).is_dir():
        _link_tree(paths[0].parent / TENSOR_DIR, folder / TENSOR_DIR, {}, result.written)
    result.rollout = folder / DUMP_FILE
    return result.rollout, result

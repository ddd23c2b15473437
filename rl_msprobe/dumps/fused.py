"""Give the training dump the fused modules the rollout has, so that they are compared at all.

vLLM fuses projections that read the same input into one column-parallel module (q/k/v into
`QKVParallelLinear`, gate/up into `MergedColumnParallelLinear`): its output is the siblings'
outputs concatenated on the last dimension. msprobe pairs the two sides' rows, but in
statistics mode it gives an aggregated row no numbers ("Diff"), so a fault in qkv_proj or
gate_up_proj would first show in the module around it.

Found from the dumps, never from names: for a rollout column-parallel module `P.X` without a
training module of that name, the training modules directly under `P`, in forward order, that
take the same input (equal statistics) and whose output widths add up to the rollout output's
width, are its parts. They are replaced, in the training copy given to msprobe, by one entry
`P.X` whose statistics are merged exactly (tp_merge.merge_stats: the fused output is their
concatenation, the fused weight too). Nothing is fused when no such run of siblings exists.
"""

from __future__ import annotations

import re

from rl_msprobe.dumps.tp_merge import COLUMN, STATS, is_tensor, merge_stats
from rl_msprobe.jsontypes import JsonObject

_KEY = re.compile(r"^Module\.(?P<name>.+)\.(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\.(?P<call>forward\.\d+)$")
WRAP = "_fsdp_wrapped_module."


def _parse(key: str) -> tuple[str, str, str] | None:
    m = _KEY.match(key)
    return (m.group("name"), m.group("cls"), m.group("call")) if m else None


def _first(entry: JsonObject, role: str) -> JsonObject | None:
    items = entry.get(role)
    return items[0] if isinstance(items, list) and items and is_tensor(items[0]) else None


def _same(a: JsonObject | None, b: JsonObject | None) -> bool:
    if not a or not b:
        return False
    return list(a["shape"]) == list(b["shape"]) and all(a.get(k) == b.get(k) for k in STATS)


def _width(leaf: JsonObject | None) -> int | None:
    return int(leaf["shape"][-1]) if leaf and leaf.get("shape") else None


def _plain(train: JsonObject) -> dict[str, tuple[str, JsonObject]]:
    """Module name without FSDP wrappers -> (key, entry), first forward entries only."""
    plain: dict[str, tuple[str, JsonObject]] = {}
    for key, entry in train.items():
        parsed = _parse(key.replace(WRAP, ""))
        if parsed and isinstance(entry, dict) and parsed[2] == "forward.0":
            plain.setdefault(parsed[0], (key, entry))
    return plain


def _siblings(plain: dict[str, tuple[str, JsonObject]], name: str) -> list[tuple[str, str, JsonObject]]:
    """The training modules directly under NAME's parent, in forward order."""
    parent = name.rsplit(".", 1)[0]
    return [
        (n, k, e)
        for n, (k, e) in plain.items()
        if n.rsplit(".", 1)[0] == parent and n != parent and "." not in n[len(parent) + 1 :]
    ]


def parts_of(train: JsonObject, name: str, width: int) -> list[tuple[str, str, int]]:
    """(module name, training key, output width) of the training modules that make the rollout's
    fused module NAME (output WIDTH wide), in their order; [] when none do (module doc)."""
    return [
        (n, k, w)
        for n, k, e in _parts(_siblings(_plain(train), name), width)
        if (w := _width(_first(e, "output")))
    ]


def fuse(train: JsonObject, rollout: JsonObject) -> tuple[JsonObject, list[str]]:
    """(training data with fused entries where the rollout has fused modules, notes)."""
    plain = _plain(train)
    # training key -> fused (key, entry), or None: dropped
    replace: dict[str, tuple[str, JsonObject] | None] = {}
    notes = []
    for rkey, rentry in rollout.items():
        parsed = _parse(rkey)
        if not parsed or parsed[1] not in COLUMN or parsed[2] != "forward.0" or parsed[0] in plain:
            continue
        name = parsed[0]
        parent = name.rsplit(".", 1)[0]
        width = _width(_first(rentry, "output"))
        parts = _parts(_siblings(plain, name), width)
        if not parts:
            continue
        first_key = parts[0][1]
        fused_key = first_key.replace(f".{parts[0][0].rsplit('.', 1)[1]}.", f".{name.rsplit('.', 1)[1]}.", 1)
        if fused_key == first_key:
            continue
        entries = [e for _, _, e in parts]
        fused = dict(entries[0])
        outs = [leaf for e in entries if (leaf := _first(e, "output")) is not None]
        assert len(outs) == len(entries), "_parts takes only siblings whose output is a tensor"
        fused["output"] = [merge_stats(outs, len(outs[0]["shape"]) - 1)]
        params: JsonObject = {}
        for pname in ("weight", "bias"):
            leaves = [(e.get("parameters") or {}).get(pname) for e in entries]
            tensors = [x for x in leaves if is_tensor(x)]
            if len(tensors) == len(leaves):
                params[pname] = merge_stats(tensors, 0)
        if params:
            fused["parameters"] = params
        replace[first_key] = (fused_key, fused)
        for _, k, _ in parts[1:]:
            replace[k] = None
        notes.append(
            f"train: {' + '.join(n.rsplit('.', 1)[1] for n, _, _ in parts)} under {parent} given to msprobe as one "
            f"{name.rsplit('.', 1)[1]} (the rollout's {parsed[1]}: same input, output widths add up to {width})"
        )
    if not replace:
        return train, []
    out: JsonObject = {}
    for key, entry in train.items():
        if key in replace:
            fused_entry = replace[key]
            if fused_entry is not None:
                out[fused_entry[0]] = fused_entry[1]
            continue
        out[key] = entry
    return out, notes


def _parts(
    siblings: list[tuple[str, str, JsonObject]], width: int | None
) -> list[tuple[str, str, JsonObject]]:
    """The first siblings in forward order that take one input and whose output widths add up to
    WIDTH (others between them, e.g. an activation, are passed over)."""
    if not width:
        return []
    for start in range(len(siblings)):
        head = _first(siblings[start][2], "input_args")
        run: list[tuple[str, str, JsonObject]] = []
        total = 0
        for item in siblings[start:]:
            if not _same(head, _first(item[2], "input_args")):
                continue
            item_width = _width(_first(item[2], "output"))
            if item_width is None:
                continue
            run.append(item)
            total += item_width
            if total >= width:
                break
        if total == width and len(run) > 1:
            return run
    return []

"""Outside git: the manifest and the saved originals in the tree's state folder, so revert is exact.

The manifest records the sets applied (oldest first) and, per file, the hash of its original and
of what rl-msprobe wrote; the originals are kept byte for byte under `originals/`. Both are written
with the tree's files, in the same journaled step (`engine.writer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_msprobe import __version__
from rl_msprobe.engine import journal
from rl_msprobe.engine.plan_parts import FileChange, Plan
from rl_msprobe.errors import UserError

MANIFEST = "manifest.json"


def manifest_path(state: Path) -> Path:
    return state / MANIFEST


def load_manifest(state: Path) -> dict[str, Any]:
    path = manifest_path(state)
    data = journal.read(path)
    if data is None:
        return {"tool": __version__, "files": {}}
    fix = f"remove {path.parent} to start afresh (revert by hand first)."
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise UserError(f"{path}: unreadable manifest ({exc}); {fix}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("files", {}), dict):
        raise UserError(f'{path}: not an rl-msprobe manifest ("files" must map paths to entries); {fix}')
    for rel, entry in doc.get("files", {}).items():
        ok = isinstance(entry, dict) and all(
            isinstance(entry.get(k), (str, type(None))) for k in ("original_sha256", "applied_sha256")
        )
        if not ok or not isinstance(entry.get("sets", []), list):
            raise UserError(f"{path}: entry files.{rel} is not an rl-msprobe manifest entry; {fix}")
    applied = doc.get("applied", [])
    if not isinstance(applied, list) or not all(isinstance(name, str) for name in applied):
        raise UserError(f'{path}: "applied" must list the names of the applied sets; {fix}')
    return doc


def recorded_in_manifest(state: Path) -> list[str]:
    """Outside git, the sets applied and not reverted since (older manifests: every file's sets)."""
    doc = load_manifest(state)
    if "applied" in doc:
        return list(doc["applied"])
    return sorted({name for entry in doc.get("files", {}).values() for name in entry.get("sets", [])})


def prefer_saved_originals(state: Path, plan: Plan) -> None:
    """Outside git: a file unchanged since apply, whose every set is being reverted, gets its saved bytes."""
    files = load_manifest(state).get("files", {})
    reverting = {s.name for s in plan.sets} | {i.name for s in plan.sets for i in s.includes}
    keeping = {r.path for r in plan.kept}
    for index, change in enumerate(plan.changes):
        entry = files.get(change.path)
        if change.path in keeping:
            continue
        saved = state / "originals" / change.path
        if not entry or not saved.is_file() or entry.get("applied_sha256") != journal.sha(change.before):
            continue
        if set(entry.get("sets", [])) - reverting:
            continue
        plan.changes[index] = FileChange(change.path, change.before, journal.read(saved), change.pieces)


def _dump(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def apply_state(state: Path, plan: Plan, recorded: list[str]) -> list[journal.Entry]:
    """The manifest and saved originals after applying `plan` (written with the files)."""
    manifest = load_manifest(state)
    manifest["applied"] = [*recorded, *(s.name for s in plan.sets if s.name not in recorded)]
    files = manifest.setdefault("files", {})
    entries = []
    for change in plan.changes:
        entry = files.get(change.path)
        if entry is None:
            entry = {"original_sha256": journal.sha(change.before), "existed": change.before is not None}
            if change.before is not None:
                saved = state / "originals" / change.path
                entries.append(
                    journal.Entry(saved, journal.read(saved), change.before, f"originals/{change.path}")
                )
            files[change.path] = entry
        entry["applied_sha256"] = journal.sha(change.after)
        entry["sets"] = sorted(set(entry.get("sets", [])) | {s.name for s in plan.sets})
    manifest["tool"] = __version__
    path = manifest_path(state)
    entries.append(journal.Entry(path, journal.read(path), _dump(manifest), MANIFEST))
    return entries


def revert_state(state: Path, plan: Plan, recorded: list[str]) -> list[journal.Entry]:
    """The manifest without the reverted files and sets, their saved originals removed."""
    path = manifest_path(state)
    if journal.read(path) is None:
        return []
    manifest = load_manifest(state)
    reverted = {s.name for s in plan.sets}
    manifest["applied"] = [name for name in recorded if name not in reverted]
    files = manifest.get("files", {})
    entries = []
    for change in plan.changes:
        files.pop(change.path, None)
        saved = state / "originals" / change.path
        data = journal.read(saved)
        if data is not None:
            entries.append(journal.Entry(saved, data, None, f"originals/{change.path}"))
    after = _dump(manifest) if files else None
    entries.append(journal.Entry(path, journal.read(path), after, MANIFEST))
    return entries


def tidy_state(state: Path) -> None:
    """Empty folders of saved originals go; with no manifest left, the lock release removes the rest."""
    originals = state / "originals"
    if not originals.is_dir():
        return
    for folder in sorted((p for p in originals.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    if not any(originals.iterdir()):
        originals.rmdir()

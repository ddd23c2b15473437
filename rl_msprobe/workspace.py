"""Plan -> diff -> atomic apply / revert / status of patch sets on one upstream tree.

Everything is computed in memory first (`plan_apply`, `plan_revert`); writing it is one
all-or-nothing step for the user (`rl_msprobe.writer`: lock, journal, then git branch and
commit, or the files plus the originals and a manifest in `<tree>/.rl-msprobe/`).
"""

from __future__ import annotations

import codecs
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import __version__, journal
from rl_msprobe.codemods.base import Codemod, Status
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet, Piece, all_sets, shape
from rl_msprobe.targets import Target

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the tree root, posix
    before: bytes | None  # None: the file does not exist yet
    after: bytes | None  # None: the file is removed
    pieces: tuple[str, ...] = ()


@dataclass(frozen=True)
class PieceReport:
    set: str
    path: str
    piece: str
    status: Status
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "codemod": self.piece, "status": self.status.value, "detail": self.detail}


@dataclass
class Plan:
    target: Target
    sets: list[PatchSet]
    changes: list[FileChange] = field(default_factory=list)
    skipped: list[PieceReport] = field(default_factory=list)  # not-applicable / native pieces
    kept: list[PieceReport] = field(default_factory=list)  # revert: pieces another applied set still uses
    capabilities: dict[str, list[shape.CapabilityReport]] = field(default_factory=dict)  # per set

    @property
    def pending(self) -> bool:
        return bool(self.changes)

    @property
    def warnings(self) -> list[str]:
        return shape.untested_warnings(self.sets, self.target.version)


# ---------------------------------------------------------------- reading files


def decode(data: bytes, path: str) -> str:
    if data.startswith(codecs.BOM_UTF8):
        raise UserError(
            f"{path}: starts with a UTF-8 byte-order mark; rl-msprobe patches plain UTF-8 sources. Remove the "
            "mark (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' FILE`) and run again."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text (byte {exc.start}); rl-msprobe only patches UTF-8 sources."
        ) from exc
    lone_cr = re.search("\r(?!\n)", text)
    if lone_cr:
        line = text.count("\n", 0, lone_cr.start()) + 1
        raise UserError(
            f"{path}:{line}: a carriage return without a line feed (old Mac line endings); rl-msprobe patches "
            "files with LF or CRLF line endings. Convert the file (e.g. `sed -i 's/\\r/\\n/g' FILE`) and run again."
        )
    return text


def _read(root: Path, rel: str) -> bytes | None:
    return journal.read(root / rel)


def _unique_pieces(sets: list[PatchSet]) -> list[tuple[PatchSet, Piece]]:
    seen: set[str] = set()
    out = []
    for patch_set in sets:
        for piece in patch_set.all_pieces():
            if piece.label not in seen:
                seen.add(piece.label)
                out.append((patch_set, piece))
    return out


def _text_reader(root: Path) -> shape.Reader:
    """Tree-relative path -> decoded text (None when absent), each file read once."""
    cache: dict[str, str | None] = {}

    def read(rel: str) -> str | None:
        if rel not in cache:
            data = _read(root, rel)
            cache[rel] = decode(data, rel) if data is not None else None
        return cache[rel]

    return read


def _applicability(piece: Piece, target: Target, read: shape.Reader) -> str | None:
    """None when the piece applies to this tree, else why not (the code found decides)."""
    source = read(piece.path) if isinstance(piece.item, Codemod) else None
    return shape.why_not(piece, source, str(target.root / piece.path), target.version)


def _refuse_native(target: Target, sets: list[PatchSet], read: shape.Reader) -> None:
    for patch_set in sets:
        refusal = shape.native_refusal(patch_set, read, target.describe())
        if refusal:
            raise UserError(refusal)


def _capabilities(
    target: Target, sets: list[PatchSet], reports: list[PieceReport], read: shape.Reader
) -> dict[str, list[shape.CapabilityReport]]:
    """Each set's capabilities from the piece reports: a piece that is not not-applicable is a site."""
    sites = {r.piece: r.path for r in reports if r.status is not Status.NOT_APPLICABLE}
    skipped = {r.piece: (r.path, r.detail) for r in reports if r.status is Status.NOT_APPLICABLE}
    describe = f"{target.project} {target.version or '(unknown version)'}"
    return {s.name: shape.capability_reports(s, sites, skipped, read, describe) for s in sets}


# ---------------------------------------------------------------- planning


def plan_apply(target: Target, sets: list[PatchSet]) -> Plan:
    """Every change applying `sets` would make; raises (writing nothing) on any missing anchor
    or capability, and for a set the tree's code already does natively."""
    read = _text_reader(target.root)
    _refuse_native(target, sets, read)
    plan = Plan(target, sets)
    texts: dict[str, tuple[bytes | None, str | None, list[str]]] = {}
    applied: list[PieceReport] = []
    for patch_set, piece in _unique_pieces(sets):
        before = texts[piece.path][0] if piece.path in texts else _read(target.root, piece.path)
        why_not = _applicability(piece, target, read)
        if not why_not:
            applied.append(PieceReport(patch_set.name, piece.path, piece.label, Status.ABSENT))
        if why_not:
            plan.skipped.append(
                PieceReport(patch_set.name, piece.path, piece.label, Status.NOT_APPLICABLE, why_not)
            )
            continue
        item = piece.item
        if isinstance(item, NewFile):
            texts[piece.path] = (before, None, [piece.label])
            if before is not None and before != item.content() and not _is_ours(before):
                raise UserError(
                    f"{target.root / piece.path}: exists and is not rl-msprobe's; move it away, then apply again."
                )
            plan.changes.append(FileChange(piece.path, before, item.content(), (piece.label,)))
            continue
        _, current, labels = texts.get(piece.path, (before, None, []))
        source = current if current is not None else decode(before or b"", piece.path)
        try:
            after_text = item.apply(source, target.version)
        except RuntimeError as exc:  # the codemod's own self-check: never write what it cannot vouch for
            raise UserError(
                f"{target.root / piece.path}: {exc}; rl-msprobe cannot patch this file safely. Nothing was "
                "changed; please report it with the file."
            ) from exc
        texts[piece.path] = (before, after_text, [*labels, piece.label])
    for rel, (before, after_text, labels) in texts.items():
        if after_text is None:
            continue
        after = after_text.encode("utf-8")
        if after != before:
            plan.changes.append(FileChange(rel, before, after, tuple(labels)))
    plan.changes = [c for c in plan.changes if c.before != c.after]
    plan.changes.sort(key=lambda c: c.path)
    plan.capabilities = _capabilities(target, sets, [*applied, *plan.skipped], read)
    shape.require_all(r for reports in plan.capabilities.values() for r in reports)
    return plan


def holders(target: Target, sets: list[PatchSet], recorded: list[str]) -> dict[str, list[str]]:
    """Piece label -> the other sets applied to this tree that use it too (a revert keeps those pieces).

    Reference counting of shared pieces: `recorded` is the tree's record of applied sets (git history
    or manifest); a recorded set counts only while one of its pieces is applied (a stale record, e.g.
    after a hand revert, keeps nothing).
    """
    known = {s.name: s for s in all_sets()}  # a set recorded by another rl-msprobe version may be gone
    labels = {piece.label for _, piece in _unique_pieces(sets)}
    read = _text_reader(target.root)
    reverting = {s.name for s in sets}
    out: dict[str, list[str]] = {}
    for name in dict.fromkeys(recorded):
        other = known.get(name) if name not in reverting else None
        if other is None or other.project != target.project:
            continue
        pieces = other.all_pieces()
        if not any(piece.label in labels for piece in pieces):
            continue
        if not any(piece_status(target, other, p, read).status is Status.APPLIED for p in pieces):
            continue
        for piece in pieces:
            if piece.label in labels:
                out.setdefault(piece.label, []).append(name)
    return out


def plan_revert(
    target: Target, sets: list[PatchSet], state: Path | None = None, keep: dict[str, list[str]] | None = None
) -> Plan:
    """Every change reverting `sets` would make (marked lines dropped, added files removed), but for the
    pieces in `keep` (label -> the applied sets still using them), which stay."""
    plan = Plan(target, sets)
    keep = keep or {}
    texts: dict[str, tuple[bytes, str, list[str]]] = {}
    for patch_set, piece in _unique_pieces(sets):
        before = _read(target.root, piece.path)
        if before is None:
            continue
        if piece.label in keep:
            detail = f"still used by {', '.join(keep[piece.label])}"
            plan.kept.append(PieceReport(patch_set.name, piece.path, piece.label, Status.APPLIED, detail))
            continue
        item = piece.item
        if isinstance(item, NewFile):
            if before == item.content() or _is_ours(before):
                plan.changes.append(FileChange(piece.path, before, None, (piece.label,)))
            continue
        _, current, labels = texts.get(piece.path, (before, decode(before, piece.path), []))
        texts[piece.path] = (before, item.revert(current), [*labels, piece.label])
    for rel, (before, after_text, labels) in texts.items():
        after = after_text.encode("utf-8")
        if after != before:
            plan.changes.append(FileChange(rel, before, after, tuple(labels)))
    _prefer_saved_originals(state or journal.state_dir(target.root, None), plan)
    plan.changes.sort(key=lambda c: c.path)
    return plan


def _is_ours(data: bytes) -> bool:
    return b"Added to this tree by rl-msprobe" in data[:2000]


# ---------------------------------------------------------------- status


def piece_status(
    target: Target, patch_set: PatchSet, piece: Piece, read: shape.Reader | None = None
) -> PieceReport:
    read = read or _text_reader(target.root)
    data = _read(target.root, piece.path)
    native = shape.native_refusal(patch_set, read, target.describe())
    if native:
        return PieceReport(patch_set.name, piece.path, piece.label, Status.NATIVE, patch_set.native_hint)
    try:
        why_not = _applicability(piece, target, read)
    except UserError as exc:
        return PieceReport(patch_set.name, piece.path, piece.label, Status.CONFLICT, str(exc))
    if why_not:
        return PieceReport(patch_set.name, piece.path, piece.label, Status.NOT_APPLICABLE, why_not)
    item = piece.item
    if isinstance(item, NewFile):
        if data is None:
            return PieceReport(patch_set.name, piece.path, piece.label, Status.ABSENT, "file not added")
        if data == item.content():
            return PieceReport(patch_set.name, piece.path, piece.label, Status.APPLIED, "file present")
        return PieceReport(
            patch_set.name,
            piece.path,
            piece.label,
            Status.CONFLICT,
            "file differs from the one this rl-msprobe adds",
        )
    report = item.status(decode(data or b"", piece.path), target.version)
    return PieceReport(patch_set.name, piece.path, piece.label, report.status, report.detail)


def set_status(reports: list[PieceReport]) -> Status:
    statuses = {r.status for r in reports if r.status is not Status.NOT_APPLICABLE}
    if not statuses:
        return Status.NOT_APPLICABLE
    if statuses == {Status.NATIVE}:
        return Status.NATIVE
    if Status.CONFLICT in statuses:
        return Status.CONFLICT
    if len(statuses) == 1:
        return next(iter(statuses))
    return Status.PARTIAL


def collect_status(target: Target, sets: list[PatchSet]) -> dict[str, Any]:
    """The JSON document of `patch status` (a killed run's journal is finished first, and reported);
    raises when a set's capability has no site in the tree."""
    from rl_msprobe.writer import recovery_for_status

    recovered = recovery_for_status(target)
    read = _text_reader(target.root)
    doc_sets = []
    for patch_set in sets:
        reports = [piece_status(target, patch_set, piece, read) for piece in patch_set.all_pieces()]
        status = set_status(reports)
        capabilities = (
            []
            if status is Status.NATIVE
            else _capabilities(target, [patch_set], reports, read)[patch_set.name]
        )
        shape.require_all(capabilities)
        doc_sets.append(
            {
                "name": patch_set.name,
                "status": status.value,
                "files": [r.to_json() for r in reports],
                "capabilities": [c.to_json() for c in capabilities],
                "notes": patch_set.notes_for(target.version),
            }
        )
    warnings = shape.untested_warnings(sets, target.version, "what its code has decides (see capabilities)")
    doc = {
        "tree": str(target.root),
        "project": target.project,
        "version": target.version,
        "tested": not warnings,
        "warnings": warnings,
        "sets": doc_sets,
    }
    if recovered:
        doc["journal"] = recovered
    return doc


def all_applied(doc: dict[str, Any]) -> bool:
    return all(s["status"] in (Status.APPLIED.value, Status.NATIVE.value) for s in doc["sets"])


# ---------------------------------------------------------------- diffs


def unified_diff(changes: list[FileChange]) -> str:
    """A diff with a/ b/ paths that `git apply` and `patch -p1` accept."""
    out: list[str] = []
    for change in changes:
        old = (
            decode(change.before, change.path).splitlines(keepends=True) if change.before is not None else []
        )
        new = decode(change.after, change.path).splitlines(keepends=True) if change.after is not None else []
        a = f"a/{change.path}" if change.before is not None else "/dev/null"
        b = f"b/{change.path}" if change.after is not None else "/dev/null"
        out.append(f"diff --git a/{change.path} b/{change.path}\n")
        if change.before is None:
            out.append("new file mode 100644\n")
        elif change.after is None:
            out.append("deleted file mode 100644\n")
        for line in difflib.unified_diff(old, new, a, b, n=3):
            if line.startswith(("---", "+++")):
                out.append(line if line.endswith("\n") else line + "\n")
                continue
            if line.endswith("\n"):
                out.append(line)
            else:
                out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


def summarize(diff_text: str) -> dict[str, Any]:
    """Files, hunks and +/- counts, read back from the diff with unidiff."""
    from unidiff import PatchSet as UnidiffPatchSet

    parsed = UnidiffPatchSet(diff_text)
    files = [
        {
            "path": (f.target_file if f.target_file != "/dev/null" else f.source_file)[2:],
            "hunks": len(f),
            "added": f.added,
            "removed": f.removed,
        }
        for f in parsed
    ]
    return {
        "files": files,
        "hunks": sum(f["hunks"] for f in files),
        "added": parsed.added,
        "removed": parsed.removed,
    }


# ---------------------------------------------------------------- the manifest (outside git)


def _manifest_path(state: Path) -> Path:
    return state / MANIFEST


def _load_manifest(state: Path) -> dict[str, Any]:
    path = _manifest_path(state)
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
    doc = _load_manifest(state)
    if "applied" in doc:
        return list(doc["applied"])
    return sorted({name for entry in doc.get("files", {}).values() for name in entry.get("sets", [])})


def _prefer_saved_originals(state: Path, plan: Plan) -> None:
    """Outside git: a file unchanged since apply, whose every set is being reverted, gets its saved bytes."""
    files = _load_manifest(state).get("files", {})
    reverting = {s.name for s in plan.sets} | {i for s in plan.sets for i in s.includes}
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
        plan.changes[index] = FileChange(change.path, change.before, saved.read_bytes(), change.pieces)

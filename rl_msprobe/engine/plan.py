"""Plan: every change applying or reverting patch sets would make to one tree, computed in memory.

Nothing is written here: `engine.writer` writes a plan all or nothing (lock, journal, then git
branch and commit, or the files plus the originals and a manifest, `engine.manifest`).
"""

from __future__ import annotations

from pathlib import Path

from rl_msprobe.codemods.base import Codemod, Status
from rl_msprobe.engine import coverage, journal
from rl_msprobe.engine.manifest import prefer_saved_originals
from rl_msprobe.engine.plan_parts import FileChange, PieceReport, Plan
from rl_msprobe.engine.sources import decode, is_ours, read_bytes, text_reader
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet, Piece, shape
from rl_msprobe.upstream.trees import Target


def unique_pieces(sets: list[PatchSet]) -> list[tuple[PatchSet, Piece]]:
    """Every piece of `sets` (included sets too), each once, with the first set that names it."""
    seen: set[str] = set()
    out = []
    for patch_set in sets:
        for piece in patch_set.all_pieces():
            if piece.label not in seen:
                seen.add(piece.label)
                out.append((patch_set, piece))
    return out


def applicability(piece: Piece, target: Target, read: shape.Reader) -> str | None:
    """None when the piece applies to this tree, else why not (the code found decides)."""
    source = read(piece.path) if isinstance(piece.item, Codemod) else None
    return shape.why_not(piece, source, str(target.root / piece.path), target.version)


def _refuse_native(target: Target, sets: list[PatchSet], read: shape.Reader) -> None:
    for patch_set in sets:
        refusal = shape.native_refusal(patch_set, read, target.describe())
        if refusal:
            raise UserError(refusal)


def set_capabilities(
    target: Target, sets: list[PatchSet], reports: list[PieceReport], read: shape.Reader
) -> dict[str, list[shape.CapabilityReport]]:
    """Each set's capabilities from the piece reports: a piece that is neither not-applicable nor
    not-covered, and whose file and code the tree has, is a site."""
    none = (Status.NOT_APPLICABLE, Status.NOT_COVERED)
    sites = {r.piece: r.path for r in reports if r.status not in none and r.site}
    skipped = {r.piece: (r.path, r.detail) for r in reports if r.status in none or not r.site}
    describe = f"{target.project} {target.version or '(unknown version)'}"
    return {s.name: shape.capability_reports(s, sites, skipped, read, describe) for s in sets}


# ---------------------------------------------------------------- planning


def plan_apply(target: Target, sets: list[PatchSet], entry_point: str | None = None) -> Plan:
    """Every change applying `sets` would make; raises (writing nothing) on any missing anchor or
    capability, for a set the tree's code already does natively, and, with `entry_point`, when a
    capability that entry point needs has no site. A piece only some entry points run whose code has
    no site here is not covered (a guard line, reported), not refused."""
    read = text_reader(target.root)
    _refuse_native(target, sets, read)
    plan = Plan(target, sets, entry_point=entry_point)
    texts: dict[str, tuple[bytes | None, str | None, list[str]]] = {}
    applied: list[PieceReport] = []
    for patch_set, piece in unique_pieces(sets):
        before = texts[piece.path][0] if piece.path in texts else read_bytes(target.root, piece.path)
        why_not = applicability(piece, target, read)
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
            if before is not None and before != item.content() and not is_ours(before):
                raise UserError(
                    f"{target.root / piece.path}: exists and is not rl-msprobe's; move it away, then apply again."
                )
            plan.changes.append(FileChange(piece.path, before, item.content(), (piece.label,)))
            continue
        _, current, labels = texts.get(piece.path, (before, None, []))
        source = current if current is not None else decode(before or b"", piece.path)
        try:
            after_text, no_site = coverage.patched_text(piece, source, target.version)
        except RuntimeError as exc:  # the codemod's own self-check: never write what it cannot vouch for
            raise UserError(
                f"{target.root / piece.path}: {exc}; rl-msprobe cannot patch this file safely. Nothing was "
                "changed; please report it with the file."
            ) from exc
        texts[piece.path] = (before, after_text, [*labels, piece.label])
        if no_site is not None:
            applied.pop()
            plan.uncovered.append(
                PieceReport(patch_set.name, piece.path, piece.label, Status.NOT_COVERED, str(no_site))
            )
    for rel, (before, patched, labels) in texts.items():
        if patched is None:
            continue
        after = patched.encode("utf-8")
        if after != before:
            plan.changes.append(FileChange(rel, before, after, tuple(labels)))
    plan.changes = [c for c in plan.changes if c.before != c.after]
    plan.changes.sort(key=lambda c: c.path)
    reports = [*applied, *plan.skipped, *plan.uncovered]
    plan.capabilities = set_capabilities(target, sets, reports, read)
    shape.require_all(r for found in plan.capabilities.values() for r in found)
    plan.not_covered = [gap for s in sets for gap in coverage.not_covered(s, reports)]
    plan.entry_points = {s.name: coverage.covered(s, plan.not_covered) for s in sets}
    if entry_point:
        coverage.require_entry(entry_point, plan.not_covered, target.describe())
    return plan


def plan_revert(
    target: Target, sets: list[PatchSet], state: Path | None = None, keep: dict[str, list[str]] | None = None
) -> Plan:
    """Every change reverting `sets` would make (marked lines dropped, added files removed), but for the
    pieces in `keep` (label -> the applied sets still using them), which stay."""
    plan = Plan(target, sets, reverting=True)
    keep = keep or {}
    texts: dict[str, tuple[bytes, str, list[str]]] = {}
    for patch_set, piece in unique_pieces(sets):
        before = read_bytes(target.root, piece.path)
        if before is None:
            continue
        if piece.label in keep:
            detail = f"still used by {', '.join(keep[piece.label])}"
            plan.kept.append(PieceReport(patch_set.name, piece.path, piece.label, Status.APPLIED, detail))
            continue
        item = piece.item
        if isinstance(item, NewFile):
            if before == item.content() or is_ours(before):
                plan.changes.append(FileChange(piece.path, before, None, (piece.label,)))
            continue
        _, current, labels = texts.get(piece.path, (before, decode(before, piece.path), []))
        texts[piece.path] = (before, item.revert(current), [*labels, piece.label])
    for rel, (before, after_text, labels) in texts.items():
        after = after_text.encode("utf-8")
        if after != before:
            plan.changes.append(FileChange(rel, before, after, tuple(labels)))
    prefer_saved_originals(state or journal.state_dir(target.root, None), plan)
    plan.changes.sort(key=lambda c: c.path)
    return plan

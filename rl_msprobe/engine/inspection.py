"""Status: where each set and piece stands in a tree, read from the files alone (and which other
applied sets still use a piece, so a revert keeps it)."""

from __future__ import annotations

from rl_msprobe.codemods.base import Codemod, Status
from rl_msprobe.engine import coverage
from rl_msprobe.engine.plan import applicability, set_capabilities, unique_pieces
from rl_msprobe.engine.plan_parts import PieceReport
from rl_msprobe.engine.recovery import recovery_for_status
from rl_msprobe.engine.results import SetStatus, TreeStatus
from rl_msprobe.engine.sources import decode, read_bytes, text_reader
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet, Piece, find_set, shape
from rl_msprobe.upstream.trees import Target


def piece_status(
    target: Target, patch_set: PatchSet, piece: Piece, read: shape.Reader | None = None
) -> PieceReport:
    read = read or text_reader(target.root)
    data = read_bytes(target.root, piece.path)
    native = shape.native_refusal(patch_set, read, target.describe())
    if native:
        return PieceReport(patch_set.name, piece.path, piece.label, Status.NATIVE, patch_set.native_hint)
    try:
        why_not = applicability(piece, target, read)
    except UserError as exc:  # an essential piece whose file or code this tree lacks: never a site
        detail = str(exc)
        if isinstance(piece.item, Codemod) and read(piece.path) is None:
            shown = target.version or "unknown"
            detail = f"not in this tree ({piece.item.name} patches it; detected version {shown})"
        return PieceReport(patch_set.name, piece.path, piece.label, Status.CONFLICT, detail, site=False)
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
    text = decode(data or b"", piece.path)
    report = item.status(text, target.version)
    if report.status is Status.CONFLICT:  # a guard line, or code no site knows: not covered
        uncovered = coverage.uncovered_status(piece, text, target.version)
        if uncovered is not None:
            return PieceReport(patch_set.name, piece.path, piece.label, uncovered.status, uncovered.detail)
    return PieceReport(patch_set.name, piece.path, piece.label, report.status, report.detail)


def set_status(reports: list[PieceReport]) -> Status:
    statuses = {r.status for r in reports if r.status not in (Status.NOT_APPLICABLE, Status.NOT_COVERED)}
    if not statuses:
        return Status.NOT_APPLICABLE
    if statuses == {Status.NATIVE}:
        return Status.NATIVE
    if Status.CONFLICT in statuses:
        return Status.CONFLICT
    if len(statuses) == 1:
        return next(iter(statuses))
    return Status.PARTIAL


def status(target: Target, sets: list[PatchSet]) -> TreeStatus:
    """`patch status` of one tree (a killed run's journal is finished first, and reported);
    raises when a set's capability has no site in the tree."""
    recovered = recovery_for_status(target)
    read = text_reader(target.root)
    found = []
    for patch_set in sets:
        reports = [piece_status(target, patch_set, piece, read) for piece in patch_set.all_pieces()]
        overall = set_status(reports)
        capabilities = (
            []
            if overall is Status.NATIVE
            else set_capabilities(target, [patch_set], reports, read)[patch_set.name]
        )
        shape.require_all(capabilities)
        missing = [] if overall is Status.NATIVE else coverage.not_covered(patch_set, reports)
        found.append(
            SetStatus(
                patch_set.name,
                overall,
                tuple(reports),
                tuple(capabilities),
                tuple(patch_set.notes_for(target.version)),
                tuple(m for m in missing if m.in_tree),
                coverage.covered(patch_set, missing),
                coverage.not_in_tree(missing),
            )
        )
    warnings = shape.untested_warnings(sets, target.version, "what its code has decides (see capabilities)")
    return TreeStatus(
        str(target.root),
        target.project,
        target.version,
        not warnings,
        tuple(warnings),
        tuple(found),
        recovered,
    )


def holders(target: Target, sets: list[PatchSet], recorded: list[str]) -> dict[str, list[str]]:
    """Piece label -> the other sets applied to this tree that use it too (a revert keeps those pieces).

    Reference counting of shared pieces: `recorded` is the tree's record of applied sets (git history
    or manifest); a recorded set counts only while one of its pieces is applied (a stale record, e.g.
    after a hand revert, keeps nothing).
    """
    labels = {piece.label for _, piece in unique_pieces(sets)}
    read = text_reader(target.root)
    reverting = {s.name for s in sets}
    out: dict[str, list[str]] = {}
    for name in dict.fromkeys(recorded):
        other = find_set(name) if name not in reverting else None  # None: a set of another version
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

"""Which entry points (`main_ppo`, `fully_async`, ...) a patched tree covers, and the pieces it does not.

A piece that only some entry points run (`Piece.runs_in`) and whose code is in the tree in a shape
no site knows is *not covered*: the rest of the set is still patched, the piece gets a guard line
(its code then fails when it runs with collection switched on), and each entry point that runs it
is reported. `patch apply --for EP` refuses when a capability EP needs has no site. Pure functions
over the piece reports; the version number plays no part.
"""

from __future__ import annotations

from collections.abc import Iterable

from rl_msprobe.codemods.base import AnchorError, Codemod, Status
from rl_msprobe.engine.plan_parts import NotCovered, PieceReport
from rl_msprobe.errors import UserError
from rl_msprobe.patches import CapabilityError, PatchSet, Piece, entry_points


def patched_text(piece: Piece, source: str, version: str | None) -> tuple[str, AnchorError | None]:
    """The file with PIECE applied; for a piece some entry points run whose code has no site here,
    the file with its guard line instead, and the anchor error that says why (else it raises)."""
    item = piece.item
    assert isinstance(item, Codemod)
    try:
        return item.apply(source, version), None
    except UserError:
        if not piece.runs_in:
            raise
        found = item.guarded(source, version)
        if found is not None:
            return found
        if not item.is_marked(source) or not item.only_guarded(source):
            raise
    # a guard line of an earlier apply, and this rl-msprobe has a site for that code now
    return item.apply(item.revert(source), version), None


def uncovered_status(piece: Piece, text: str, version: str | None) -> PieceReport | None:
    """`patch status` of a piece whose code has no site here (guarded or not yet), else None."""
    item = piece.item
    if not piece.runs_in or not isinstance(item, Codemod):
        return None
    found = item.guarded(text, version)
    if found is None:
        if item.is_marked(text) and item.only_guarded(text):  # this rl-msprobe has a site for it now
            detail = (
                "a guard line of an earlier apply; this rl-msprobe has a site here: apply again to patch it"
            )
            return PieceReport("", piece.path, piece.label, Status.PARTIAL, detail)
        return None
    guarded, error = found
    where = "guard line in place" if guarded == text and guarded != item.revert(text) else "not applied"
    return PieceReport("", piece.path, piece.label, Status.NOT_COVERED, f"{error} ({where})")


def not_covered(patch_set: PatchSet, reports: Iterable[PieceReport]) -> list[NotCovered]:
    """Per entry point of the set's project, each capability it needs that has no site here."""
    status = {r.piece: r for r in reports}
    pieces = patch_set.all_pieces()
    out: list[NotCovered] = []
    for entry in entry_points(patch_set.project):
        for cap in patch_set.all_capabilities():
            needed = [
                p for p in pieces if p.label in cap.pieces and p.run_by(entry.name) and p.label in status
            ]
            if not any(p.runs_in for p in needed):
                continue  # every job runs these pieces: the set's own capability check covers them
            missing = [p for p in needed if status[p.label].status is Status.NOT_COVERED]
            for piece in missing:
                report = status[piece.label]
                out.append(
                    NotCovered(
                        entry.name, patch_set.name, cap.name, piece.label, piece.path, report.detail, True
                    )
                )
            sites = [
                p for p in needed if status[p.label].status not in (Status.NOT_APPLICABLE, Status.NOT_COVERED)
            ]
            if not missing and not sites:
                why = "; ".join(f"{p.label}: {status[p.label].detail}" for p in needed)
                out.append(NotCovered(entry.name, patch_set.name, cap.name, "", "", why, False))
    return out


def covered(patch_set: PatchSet, missing: list[NotCovered]) -> dict[str, bool]:
    """Entry point -> does this tree give it every capability of the set?"""
    gaps = {m.entry_point for m in missing if m.set == patch_set.name}
    return {e.name: e.name not in gaps for e in entry_points(patch_set.project)}


def not_in_tree(missing: Iterable[NotCovered]) -> tuple[str, ...]:
    """The entry points whose code this tree lacks altogether (verl 0.9.1 has no main_ppo_sync.py,
    so no piece of that trainer applies): "not in this tree", never "NOT covered". An entry point
    with code in the tree that no site knows stays NOT covered."""
    gaps = list(missing)
    in_tree = {m.entry_point for m in gaps if m.in_tree}
    return tuple(dict.fromkeys(m.entry_point for m in gaps if not m.in_tree and m.entry_point not in in_tree))


def require_entry(entry: str, missing: Iterable[NotCovered], describe: str) -> None:
    """Refuse (exit 2, nothing written) when entry point ENTRY lacks a capability it needs."""
    gaps = [m for m in missing if m.entry_point == entry]
    if not gaps:
        return
    fix = (
        "A newer rl-msprobe may know this shape (update it and apply again); the other entry points "
        "are listed by `rl-msprobe patch apply` without --for."
        if any(m.in_tree for m in gaps)
        else f"This tree lacks the code {entry} runs: patch the tree that job runs, or pass the entry point it has."
    )
    raise CapabilityError(
        f"--for {entry}: {describe}: "
        + " ".join(f"{m.text()}." for m in gaps)
        + f" {fix} Nothing was changed."
    )

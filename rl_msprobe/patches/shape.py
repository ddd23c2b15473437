"""What the tree's code says: which pieces apply, which capabilities have a site, native support.

Pure decisions over file contents (the caller reads the files): the version number plays no
part here; see the capability model in `rl_msprobe.patches`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rl_msprobe.codemods.base import Codemod
from rl_msprobe.errors import UserError
from rl_msprobe.patches.patch_set import CapabilityError, PatchSet, Piece

Reader = Callable[[str], "str | None"]  # tree-relative path -> text, None when the file is not there


def why_not(piece: Piece, source: str | None, where: str, version: str | None) -> str | None:
    """None when `piece` applies to a file with `source` (None: no such file), else why not.

    Raises when an essential piece cannot apply. `where` is the file as shown to the user.
    """
    item = piece.item
    if not isinstance(item, Codemod):
        return None
    shown = version or "unknown"
    if source is None:
        if piece.essential:
            raise UserError(
                f"{where}: missing; {item.name} needs it (detected version {shown}), expected "
                f"{item.subject_text()}. Is --tree the folder that holds the package?"
            )
        return _joined(f"{item.path} is not in this tree", piece.why_optional)
    if not item.present(source):
        if piece.essential:
            raise UserError(
                f"{where}: {item.subject_text()} not found (detected version {shown}); {item.name} patches it. "
                "The file differs from every release rl-msprobe knows: update rl-msprobe."
            )
        return _joined(f"{item.path} has no {item.subject_text()}", piece.why_optional)
    return None


def _joined(reason: str, extra: str) -> str:
    return f"{reason} ({extra})" if extra else reason


@dataclass(frozen=True)
class CapabilityReport:
    """One capability in one tree: the files that deliver it, or every file searched."""

    name: str
    where: str
    sites: tuple[str, ...]  # paths of the pieces that patch it here
    searched: tuple[str, ...]  # "path: why not" for the pieces that do not apply
    problem: str = ""  # set when the capability is not delivered

    @property
    def found(self) -> bool:
        return not self.problem

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "where": self.where,
            "found": self.found,
            "sites": list(self.sites),
            "searched": list(self.searched),
            **({"problem": self.problem} if self.problem else {}),
        }


def capability_reports(
    patch_set: PatchSet,
    sites: dict[str, str],
    skipped: dict[str, tuple[str, str]],
    read: Reader,
    describe: str,
) -> list[CapabilityReport]:
    """Each capability of `patch_set`: sites = {label: path} of pieces that apply, skipped =
    {label: (path, why not)}; `describe` names the tree in messages ("verl 0.10.0.dev")."""
    reports = []
    for cap in patch_set.all_capabilities():
        found = tuple(dict.fromkeys(sites[label] for label in cap.pieces if label in sites))
        searched = tuple(_searched(*skipped[label]) for label in cap.pieces if label in skipped)
        problem = ""
        if cap.probe is not None and not cap.probe.holds(read(cap.probe.path)):
            problem = (
                f"{patch_set.name}: capability '{cap.name}' needs {cap.probe.expected} in {cap.probe.path}, "
                f"which this {describe} tree does not have. {cap.why}"
            ).strip()
        elif not found:
            problem = (
                f"{patch_set.name}: capability '{cap.name}' ({cap.where}) has no patched site in this {describe} "
                f"tree; searched {'; '.join(searched) or 'no file'}. {cap.why}"
            ).strip()
        reports.append(CapabilityReport(cap.name, cap.where, found, searched, problem))
    return reports


def _searched(path: str, detail: str) -> str:
    return detail if detail.startswith(path) else f"{path}: {detail}"


def require_all(reports: Iterable[CapabilityReport]) -> None:
    """Refuse (exit 2) when any capability is not delivered."""
    problems = [r.problem for r in reports if r.problem]
    if problems:
        raise CapabilityError(" ".join(problems) + " Nothing was changed.")


def native_refusal(patch_set: PatchSet, read: Reader, describe: str) -> str | None:
    """The refusal text when the tree's code does this set's job natively, else None."""
    probe = patch_set.native
    if probe is None or not probe.holds(read(probe.path)):
        return None
    return (
        f"{patch_set.name}: {describe} supports this natively ({probe.expected} in {probe.path}); "
        f"no patch is needed. {patch_set.native_hint}"
    ).strip()


def untested_warnings(sets: Iterable[PatchSet], version: str | None, tail: str | None = None) -> list[str]:
    """One warning per set whose tested releases do not include `version`."""
    return [w for s in sets if (w := s.untested_warning(version, *([tail] if tail else [])))]

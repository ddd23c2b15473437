"""What `rl-msprobe patch list` shows and docs/support.md's version table: one frozen row per set of
the registry, in its order, so the command, its JSON and the docs read the same rows.

`SetList.to_json()` is `patch list --json`: an array (it predates the `schema` key, docs/json.md),
one object per set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_msprobe.patches.default_release import default_release
from rl_msprobe.patches.patch_set import PatchSet
from rl_msprobe.patches.registry import all_sets

# text column -> its header, in the order `patch list` prints them (the description follows, unaligned)
COLUMNS = {"name": "SET", "project": "PROJECT", "versions": "VERSIONS", "default_release": "DEFAULT"}


@dataclass(frozen=True)
class PieceRow:
    """One piece of a set: its codemod's or new file's label, the file, and the entry points it serves."""

    name: str
    path: str
    essential: bool
    runs_in: tuple[str, ...]


@dataclass(frozen=True)
class SetInfo:
    """One set as `patch list` shows it: the tested range, the release read without --tree, its pieces."""

    name: str
    project: str
    versions: str
    default_release: str
    native_since: str | None
    optional: bool
    description: str
    pieces: tuple[PieceRow, ...]

    @classmethod
    def of(cls, patch_set: PatchSet) -> SetInfo:
        pieces = tuple(
            PieceRow(p.label, p.path, p.essential, tuple(e.name for e in p.runs_in))
            for p in patch_set.all_pieces()
        )
        return cls(
            patch_set.name,
            patch_set.project,
            patch_set.range_text(),
            default_release(patch_set),
            patch_set.native_since,
            patch_set.optional,
            patch_set.description,
            pieces,
        )

    def to_json(self) -> dict[str, object]:
        """The set's object in `patch list --json`: its fields in order, tuples as arrays."""
        doc = dataclasses.asdict(self)
        doc["pieces"] = [{**piece, "runs_in": list(piece["runs_in"])} for piece in doc["pieces"]]
        return doc


@dataclass(frozen=True)
class SetList:
    """Every set of the registry, in its order."""

    sets: tuple[SetInfo, ...]

    def to_json(self) -> list[dict[str, object]]:
        return [s.to_json() for s in self.sets]

    def text_lines(self) -> list[str]:
        """The aligned table `patch list` prints: a header, one line per set, the description last."""
        header = {**COLUMNS, "description": "DESCRIPTION"}
        rows = [header, *({key: str(getattr(s, key)) for key in header} for s in self.sets)]
        widths = {key: max(len(row[key]) for row in rows) for key in COLUMNS}
        return [
            "  ".join([*(f"{row[key]:<{widths[key]}}" for key in COLUMNS), row["description"]]).rstrip()
            for row in rows
        ]

    def support_table(self) -> str:
        """docs/support.md's version table (checked against it by tests/patches/test_listing.py)."""
        lines = ["| set | project | versions | default release |", "|---|---|---|---|"]
        lines += [f"| `{s.name}` | {s.project} | {s.versions} | {s.default_release} |" for s in self.sets]
        return "\n".join(lines) + "\n"


def list_sets() -> SetList:
    """Every set of the registry, loaded (their modules imported), with its default release."""
    return SetList(tuple(SetInfo.of(s) for s in all_sets()))

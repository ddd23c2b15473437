"""Patch sets: named groups of codemods and added files, with the versions they support.

A set lists *pieces*. A piece is one codemod (one upstream file) or one file added to the
tree verbatim (from `patches/files/<project>/...`). A piece may exist only for some
versions or only where the tree ships its file; the set then reports it as
`not-applicable` with the reason instead of failing — unless the piece is essential.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources

from rl_msprobe.codemods.base import Codemod, version_in_range
from rl_msprobe.errors import UserError


@dataclass(frozen=True)
class NewFile:
    """A file rl-msprobe adds to the upstream tree (e.g. the training-side helper)."""

    project: str
    path: str  # relative to the tree root, posix
    name: str = ""
    min_version: str | None = None
    max_version: str | None = None

    @property
    def label(self) -> str:
        return self.name or f"file:{self.path}"

    def content(self) -> bytes:
        return resources.files("rl_msprobe.patches").joinpath("files", self.project, self.path).read_bytes()

    def digest(self) -> str:
        return hashlib.sha256(self.content()).hexdigest()

    def supports(self, version: str | None) -> bool:
        return version_in_range(version, self.min_version, self.max_version)


@dataclass(frozen=True)
class Piece:
    """One part of a set. `essential=False` pieces may be missing for a version or a tree."""

    item: Codemod | NewFile
    essential: bool = True
    why_optional: str = ""  # shown when the piece is not applicable
    # codemods of non-essential pieces: True: a tree without the file -> not-applicable;
    # False: the file is required whenever the version is in the piece's range (missing -> error)
    needs_file: bool = True

    @property
    def label(self) -> str:
        return self.item.name if isinstance(self.item, Codemod) else self.item.label

    @property
    def path(self) -> str:
        return self.item.path


@dataclass(frozen=True)
class PatchSet:
    name: str
    project: str
    description: str
    pieces: tuple[Piece, ...] = ()
    includes: tuple[str, ...] = ()
    min_version: str | None = None
    max_version: str | None = None
    native_since: str | None = None  # versions from here support this natively
    native_hint: str = ""  # what to use instead, for the refusal
    below_min_reason: str = ""  # why versions below min_version are refused (shown with the refusal)
    optional: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (min_version, max_version, text): notes that hold only for some versions
    version_notes: tuple[tuple[str | None, str | None, str], ...] = field(default_factory=tuple)

    def notes_for(self, version: str | None) -> list[str]:
        """The notes that hold for this version (all version notes when the version is unknown)."""
        scoped = [text for low, high, text in self.version_notes if version_in_range(version, low, high)]
        return [*self.notes, *scoped]

    def all_pieces(self) -> tuple[Piece, ...]:
        """This set's pieces and those of included sets, each once, in order."""
        seen: dict[str, Piece] = {}
        for included in self.includes:
            for piece in get_set(included).all_pieces():
                seen.setdefault(piece.label, piece)
        for piece in self.pieces:
            seen.setdefault(piece.label, piece)
        return tuple(seen.values())

    def range_text(self) -> str:
        return f"{self.min_version or 'any'} … {self.max_version or 'newest'}"

    def check_version(self, version: str | None) -> None:
        """Refuse versions outside the set's range (with the range and the reason)."""
        if self.native_since and version and version_in_range(version, self.native_since, None):
            raise UserError(
                f"{self.name}: {self.project} {version} supports this natively (since {self.native_since}); "
                f"no patch is needed. {self.native_hint}"
            )
        if not version_in_range(version, self.min_version, self.max_version):
            below = self.below_min_reason if not version_in_range(version, self.min_version, None) else ""
            raise UserError(
                f"{self.name}: {self.project} {version} is not supported; this set supports "
                f"{self.project} {self.range_text()}. {below + ' ' if below else ''}"
                "Use a supported release or update rl-msprobe."
            )

    def is_native(self, version: str | None) -> bool:
        return bool(self.native_since and version and version_in_range(version, self.native_since, None))


_REGISTRY: dict[str, PatchSet] = {}


def register(patch_set: PatchSet) -> PatchSet:
    if patch_set.name in _REGISTRY:
        raise ValueError(f"patch set {patch_set.name} registered twice")
    _REGISTRY[patch_set.name] = patch_set
    return patch_set


def _load_all() -> None:
    # Importing the modules registers their sets; each area keeps its own module.
    from rl_msprobe.patches import verl, verl_triage  # noqa: F401

    for optional in (
        "rl_msprobe.patches.sglang",
        "rl_msprobe.patches.vllm_ascend",
        "rl_msprobe.patches.vllm",
    ):
        try:
            __import__(optional)
        except ModuleNotFoundError as exc:
            if exc.name != optional:
                raise


def all_sets() -> list[PatchSet]:
    if not _REGISTRY:
        _load_all()
    return list(_REGISTRY.values())


def get_set(name: str) -> PatchSet:
    if not _REGISTRY:
        _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(
            f"unknown patch set {name!r}; known sets: {known} (see `rl-msprobe patch list`)."
        ) from None


def resolve_sets(names: list[str] | tuple[str, ...]) -> list[PatchSet]:
    """The sets named on the command line; all for one project."""
    if not names:
        raise UserError("name at least one patch set (see `rl-msprobe patch list`).")
    sets = [get_set(n) for n in dict.fromkeys(names)]
    projects = {s.project for s in sets}
    if len(projects) > 1:
        raise UserError(
            f"sets {', '.join(s.name for s in sets)} are for different projects ({', '.join(sorted(projects))}); "
            "patch one tree at a time."
        )
    return sets

"""The patch-set model: named groups of codemods and added files, and the capabilities each must deliver.

The capability model (every set follows it; `rl-msprobe patch diff|apply|status` enforce it):

- A set lists *pieces*. A piece is one codemod (one upstream file) or one file added to the
  tree verbatim (from `patches/files/<project>/...`).
- **Shape decides whether a piece applies**, never the version number. A codemod piece applies
  when its file is in the tree and the file holds the codemod's *subject* (`Codemod.present`:
  e.g. class `AsyncLLMServerManager` in agent_loop.py; most codemods: the file's presence).
  Once it applies, every anchor it requires must be found (which variant is required follows
  from the file too), else the run stops with the file, the anchor and what was expected.
  An `essential` piece must apply (file and subject present); a non-essential one whose file
  or subject is absent is reported `not-applicable`, with the reason, and nothing else.
- **Capabilities** say what the set promises (`Capability`: "engine hook", "PROMPTS_ONLY trim",
  "request-id record", "create / start / stop sites", ...), each with the pieces that can deliver
  it. A capability is delivered when at least one of its pieces has a patched site in this
  tree; a `Probe` may also require code the capability depends on (a class that must exist for
  the patched site to ever run). A capability with no site is an error (exit 2) that names the
  capability and every file searched with what was (not) found: never a silent gap.
- **Native support** is recognised from the code as well (`PatchSet.native`: a `Probe` that,
  when it holds, means upstream does this itself; the set is then refused with what to use).
- **Entry points** (`EntryPoint`: `main_ppo`, `fully_async`, ...) say which trainer and rollout
  path a job runs. A piece that only some entry points run lists them (`Piece.runs_in`); when its
  code is in the tree but none of its anchors' shapes is (a trainer rl-msprobe does not know
  yet), it is *not covered*: the other pieces are patched, the piece gets a marked guard line
  that fails at run time when that code runs with collection switched on, and every entry point
  that runs it is reported not covered. `patch apply --for EP` refuses when a capability EP needs
  has no site (`entry_coverage`).
- **Versions are information only**: `min_version`/`max_version` are the range of releases the
  tests prove (the default release of `patch diff`, notes, `tested`). A tree outside that
  range, or a dev / rc / local build, is patched when every capability is found, with a warning
  and `"tested": false`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from packaging.version import Version

from rl_msprobe.codemods.base import Codemod, parse_version, top_level_classes, version_in_range
from rl_msprobe.errors import UserError


@dataclass(frozen=True)
class NewFile:
    """A file rl-msprobe adds to the upstream tree (e.g. the training-side helper)."""

    project: str
    path: str  # relative to the tree root, posix
    name: str = ""
    source: str = ""  # under patches/files/ when the same file goes into two projects' trees

    @property
    def label(self) -> str:
        return self.name or f"file:{self.path}"

    def content(self) -> bytes:
        where = self.source or f"{self.project}/{self.path}"
        return resources.files("rl_msprobe.patches").joinpath("files", *where.split("/")).read_bytes()

    def digest(self) -> str:
        return hashlib.sha256(self.content()).hexdigest()


@dataclass(frozen=True)
class EntryPoint:
    """What a job runs: `patch apply --for NAME` needs only the pieces that NAME runs.

    `modules` are the launch-script entries (python -m MODULE, or a script path ending in
    MODULE's file) that start it; `prepare` and `check` read them to print `--for NAME`.
    """

    name: str
    project: str
    modules: tuple[str, ...]
    description: str

    def started_by(self, entry: str) -> bool:
        """Does the launch script's verl entry (`verl.trainer.main_ppo`, `.../fully_async_main.py`) start it?"""
        dotted = entry.removesuffix(".py").replace("/", ".")
        return any(dotted == module or dotted.endswith("." + module) for module in self.modules)


@dataclass(frozen=True)
class Piece:
    """One part of a set. `essential=False`: not-applicable (with `why_optional`) where its file
    or the codemod's subject is not in the tree. `runs_in`: the entry points whose jobs run this
    piece's code (empty: every job); such a piece is *not covered*, not refused, where its code
    has no site rl-msprobe knows."""

    item: Codemod | NewFile
    essential: bool = True
    why_optional: str = ""  # shown after the shape reason when the piece is not applicable
    runs_in: tuple[EntryPoint, ...] = ()

    def run_by(self, entry: str) -> bool:
        """Does a job of entry point `entry` run this piece's code?"""
        return not self.runs_in or any(e.name == entry for e in self.runs_in)

    @property
    def label(self) -> str:
        return self.item.name if isinstance(self.item, Codemod) else self.item.label

    @property
    def path(self) -> str:
        return self.item.path


@dataclass(frozen=True)
class Probe:
    """Code a capability (or native support) depends on: `check(source)` on one file of the tree."""

    path: str
    expected: str  # what must be there, in words ("class ActorRolloutRefWorker")
    check: Callable[[str], bool]

    def holds(self, source: str | None) -> bool:
        return source is not None and self.check(source)


def defines_class(path: str, cls: str) -> Probe:
    return Probe(path, f"class {cls}", lambda source: cls in top_level_classes(source))


@dataclass(frozen=True)
class Capability:
    """Something a set promises to deliver, and the pieces (labels) that can deliver it.

    Delivered when at least one of `pieces` has a patched site in the tree (and `probe`, if any,
    holds). `where` says, in words, where the site is expected; `why` explains a failed probe.
    """

    name: str
    where: str
    pieces: tuple[str, ...]
    probe: Probe | None = None
    why: str = ""


class CapabilityError(UserError):
    """A capability has no patched site in this tree (or the code it depends on is missing)."""


@dataclass(frozen=True)
class PatchSet:
    name: str
    project: str
    description: str
    pieces: tuple[Piece, ...] = ()
    includes: tuple[PatchSet, ...] = ()  # whole sets this one contains (verl-consistency)
    capabilities: tuple[Capability, ...] = ()
    min_version: str | None = None  # oldest release the tests prove (information)
    max_version: str | None = None  # newest release the tests prove (information; None: the newest one)
    native: Probe | None = None  # holds: upstream does this itself, no patch is needed
    native_since: str | None = None  # the first release with native support (information)
    native_hint: str = ""  # what to use instead, for the refusal
    optional: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (min_version, max_version, text): notes that hold only for some versions (information)
    version_notes: tuple[tuple[str | None, str | None, str], ...] = field(default_factory=tuple)

    def notes_for(self, version: str | None) -> list[str]:
        """The notes that hold for this version (all version notes when the version is unknown)."""
        scoped = [text for low, high, text in self.version_notes if version_in_range(version, low, high)]
        return [*self.notes, *scoped]

    def all_pieces(self) -> tuple[Piece, ...]:
        """This set's pieces and those of included sets, each once, in order."""
        seen: dict[str, Piece] = {}
        for included in self.includes:
            for piece in included.all_pieces():
                seen.setdefault(piece.label, piece)
        for piece in self.pieces:
            seen.setdefault(piece.label, piece)
        return tuple(seen.values())

    def all_capabilities(self) -> tuple[Capability, ...]:
        """This set's capabilities and those of included sets, each once (by name), in order."""
        seen: dict[str, Capability] = {}
        for included in self.includes:
            for capability in included.all_capabilities():
                seen.setdefault(capability.name, capability)
        for capability in self.capabilities:
            seen[capability.name] = capability  # the including set may sharpen an included one
        return tuple(seen.values())

    def range_text(self) -> str:
        return f"{self.min_version or 'any'} … {self.max_version or 'newest'}"

    def tested(self, version: str | None) -> bool:
        """Is `version` a release inside the range the tests prove (not a dev or local build)?"""
        parsed = parse_version(version)
        if parsed is None or parsed.is_devrelease or parsed.local:
            return False
        return version_in_range(version, self.min_version, self.max_version)

    def untested_warning(
        self, version: str | None, tail: str = "all anchors found; review the diff"
    ) -> str | None:
        """The warning for a version the tests do not prove (None for a tested one)."""
        if self.tested(version):
            return None
        parsed = parse_version(version)
        shown = f"{self.project} {version or '(unknown version)'}"
        public = Version(parsed.public) if parsed is not None else None  # 0.9.1+local is 0.9.1 here
        if public is not None and self.max_version and public > Version(self.max_version):
            why = f"is newer than the newest tested release {self.max_version}"
        elif public is not None and self.min_version and public < Version(self.min_version):
            why = f"is older than the oldest tested release {self.min_version}"
        elif parsed is not None and (parsed.is_devrelease or parsed.local):
            why = f"is a development build (tested releases: {self.range_text()})"
        else:
            why = f"is not a tested release ({self.range_text()})"
        return f"{self.name}: {shown} {why}: {tail}."


def where_present(codemod: Codemod, why: str, runs_in: tuple[EntryPoint, ...] = ()) -> Piece:
    """A piece that applies where the tree has its file (and the codemod's subject); `why` says
    which upstream release has it; `runs_in` the entry points that run it. A capability still
    needs one site among its pieces."""
    return Piece(codemod, essential=False, why_optional=why, runs_in=runs_in)


def runs_in(codemod: Codemod, *entry_points: EntryPoint) -> Piece:
    """A piece every tree has (essential) that only the jobs of `entry_points` run."""
    return Piece(codemod, runs_in=entry_points)

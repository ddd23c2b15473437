"""Plan -> diff -> atomic apply / revert / status of patch sets on one upstream tree.

Everything is computed in memory first (`plan_apply`, `plan_revert`); writing is one
all-or-nothing step (`write_all`). On a git checkout apply makes a branch and a commit and
revert makes a revert commit on the current branch; elsewhere the originals and a
manifest are kept in `<tree>/.rl-msprobe/` so revert can restore the exact bytes.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_msprobe import __version__
from rl_msprobe.codemods.base import Codemod, Status
from rl_msprobe.errors import UserError
from rl_msprobe.patches import NewFile, PatchSet, Piece, shape
from rl_msprobe.targets import Target

STATE_DIR = ".rl-msprobe"
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
    capabilities: dict[str, list[shape.CapabilityReport]] = field(default_factory=dict)  # per set

    @property
    def pending(self) -> bool:
        return bool(self.changes)

    @property
    def warnings(self) -> list[str]:
        return shape.untested_warnings(self.sets, self.target.version)


# ---------------------------------------------------------------- reading files


def decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text (byte {exc.start}); rl-msprobe only patches UTF-8 sources."
        ) from exc


def _read(root: Path, rel: str) -> bytes | None:
    path = root / rel
    return path.read_bytes() if path.is_file() else None


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
        texts[piece.path] = (before, item.apply(source, target.version), [*labels, piece.label])
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


def plan_revert(target: Target, sets: list[PatchSet]) -> Plan:
    """Every change reverting `sets` would make (marked lines dropped, added files removed)."""
    plan = Plan(target, sets)
    texts: dict[str, tuple[bytes, str, list[str]]] = {}
    for _, piece in _unique_pieces(sets):
        before = _read(target.root, piece.path)
        if before is None:
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
    _prefer_saved_originals(target.root, plan)
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
    """The JSON document of `patch status`; raises when a set's capability has no site in the tree."""
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
    return {
        "tree": str(target.root),
        "project": target.project,
        "version": target.version,
        "tested": not warnings,
        "warnings": warnings,
        "sets": doc_sets,
    }


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


# ---------------------------------------------------------------- writing


def _preflight(root: Path, changes: list[FileChange]) -> None:
    """Refuse before writing anything when any file could not be written."""
    for change in changes:
        path = root / change.path
        if path.exists():
            mode = path.stat().st_mode
            if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
                raise UserError(
                    f"{path}: read-only; make it writable (chmod u+w) and run again. Nothing was changed."
                )
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            raise UserError(f"{parent}: folder is not writable; nothing was changed.")


def _write_one(root: Path, rel: str, data: bytes | None) -> None:
    path = root / rel
    if data is None:
        if path.exists():
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_all(root: Path, changes: list[FileChange], checked: bool = False) -> None:
    """Write every change or none: a failure part-way restores what was already written.

    `checked`: the caller already ran the preflight (apply does, before it makes a branch).
    """
    if not checked:
        _preflight(root, changes)
    done: list[FileChange] = []
    try:
        for change in changes:
            _write_one(root, change.path, change.after)
            done.append(change)
    except OSError as exc:
        for change in reversed(done):
            _write_one(root, change.path, change.before)
        raise UserError(
            f"{root / change.path}: could not be written ({exc.strerror}); every file was restored."
        ) from exc


# ---------------------------------------------------------------- git / manifest


def open_repo(root: Path) -> Any | None:
    """The git repository holding the tree, or None (GitPython is imported only here)."""
    import git

    try:
        return git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None


def _repo_paths(repo: Any, root: Path, changes: list[FileChange]) -> list[str]:
    top = Path(repo.working_tree_dir).resolve()
    return [str((root / c.path).resolve().relative_to(top)) for c in changes]


def _commit(repo: Any, paths: list[str], message: str) -> str:
    repo.git.add("-A", "--", *paths)
    env = {}
    reader = repo.config_reader()
    if not reader.has_option("user", "name"):
        env.update(GIT_AUTHOR_NAME="rl-msprobe", GIT_COMMITTER_NAME="rl-msprobe")
    if not reader.has_option("user", "email"):
        env.update(GIT_AUTHOR_EMAIL="rl-msprobe@localhost", GIT_COMMITTER_EMAIL="rl-msprobe@localhost")
    with repo.git.custom_environment(**env):
        repo.git.commit("-m", message, "--", *paths)
    return repo.head.commit.hexsha


def default_branch(sets: list[PatchSet]) -> str:
    return "rl-msprobe/" + "+".join(s.name for s in sets)


def _message(verb: str, target: Target, sets: list[PatchSet], plan: Plan) -> str:
    lines = [
        f"rl-msprobe: {verb} {', '.join(s.name for s in sets)}",
        "",
        f"Sets: {', '.join(s.name for s in sets)}",
        f"Upstream: {target.project} {target.version or 'unknown'}",
        f"Tool: rl-msprobe {__version__}",
        "Files:",
        *(f"  {c.path} ({', '.join(c.pieces)})" for c in plan.changes),
    ]
    return "\n".join(lines) + "\n"


def _check_git_clean(repo: Any, root: Path, changes: list[FileChange], allow_dirty: bool) -> None:
    dirty = [item.a_path for item in repo.index.diff(None)] + [
        item.a_path for item in repo.index.diff("HEAD")
    ]
    if not dirty:
        return
    if not allow_dirty:
        raise UserError(
            f"{repo.working_tree_dir}: uncommitted changes ({', '.join(sorted(set(dirty))[:5])}); commit or stash "
            "them, or pass --allow-dirty (your changes are then left as they are)."
        )
    touched = set(_repo_paths(repo, root, changes))
    clash = sorted(touched & set(dirty))
    if clash:
        raise UserError(
            f"{', '.join(clash)}: has uncommitted changes and would be patched; commit or stash it first "
            "(even with --allow-dirty rl-msprobe never mixes your edits into its commit)."
        )


def _manifest_path(root: Path) -> Path:
    return root / STATE_DIR / MANIFEST


def _load_manifest(root: Path) -> dict[str, Any]:
    path = _manifest_path(root)
    if not path.is_file():
        return {"tool": __version__, "files": {}}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: unreadable manifest ({exc}); remove it to start afresh.") from exc


def _sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _record_originals(root: Path, plan: Plan) -> None:
    manifest = _load_manifest(root)
    files = manifest.setdefault("files", {})
    for change in plan.changes:
        entry = files.get(change.path)
        if entry is None:
            entry = {"original_sha256": _sha(change.before), "existed": change.before is not None}
            if change.before is not None:
                saved = root / STATE_DIR / "originals" / change.path
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_bytes(change.before)
            files[change.path] = entry
        entry["applied_sha256"] = _sha(change.after)
        entry["sets"] = sorted(set(entry.get("sets", [])) | {s.name for s in plan.sets})
    manifest["tool"] = __version__
    path = _manifest_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _prefer_saved_originals(root: Path, plan: Plan) -> None:
    """Outside git: a file unchanged since apply, whose every set is being reverted, gets its saved bytes."""
    files = _load_manifest(root).get("files", {})
    reverting = {s.name for s in plan.sets} | {i for s in plan.sets for i in s.includes}
    for index, change in enumerate(plan.changes):
        entry = files.get(change.path)
        saved = root / STATE_DIR / "originals" / change.path
        if not entry or not saved.is_file() or entry.get("applied_sha256") != _sha(change.before):
            continue
        if set(entry.get("sets", [])) - reverting:
            continue
        plan.changes[index] = FileChange(change.path, change.before, saved.read_bytes(), change.pieces)


def _forget_originals(root: Path, plan: Plan) -> None:
    manifest = _load_manifest(root)
    files = manifest.get("files", {})
    for change in plan.changes:
        files.pop(change.path, None)
        saved = root / STATE_DIR / "originals" / change.path
        if saved.is_file():
            saved.unlink()
    state = root / STATE_DIR
    if files:
        _manifest_path(root).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    elif state.exists():
        import shutil

        shutil.rmtree(state)


# ---------------------------------------------------------------- apply / revert


def _result(plan: Plan) -> dict[str, Any]:
    """The JSON document of `patch apply` / `patch revert` (git and noop filled in later)."""
    return {
        "tree": str(plan.target.root),
        "project": plan.target.project,
        "version": plan.target.version,
        "sets": [s.name for s in plan.sets],
        "changed": [c.path for c in plan.changes],
        "skipped": [r.to_json() for r in plan.skipped],
        "git": None,
        "noop": not plan.changes,
        "tested": not plan.warnings,
        "warnings": plan.warnings,
    }


def _writable(target: Target) -> None:
    if target.readonly:
        raise UserError(
            f"{target.origin}: a fetched release is read-only (diff and status only); pass --tree PATH or "
            "--python PY to patch the tree that runs."
        )


def apply(
    target: Target,
    sets: list[PatchSet],
    branch: str | None = None,
    make_branch: bool = True,
    allow_dirty: bool = False,
) -> dict[str, Any]:
    """Apply `sets` to the tree: all files or none; on git a branch and a commit."""
    _writable(target)
    plan = plan_apply(target, sets)
    result = _result(plan)
    if not plan.changes:
        return result
    repo = open_repo(target.root)
    if repo is not None:
        _check_git_clean(repo, target.root, plan.changes, allow_dirty)
        _preflight(target.root, plan.changes)
        original_branch = None if repo.head.is_detached else repo.active_branch.name
        name = branch or default_branch(sets)
        new_branch = make_branch and original_branch != name
        if new_branch:
            if name in [h.name for h in repo.heads]:
                raise UserError(
                    f"branch {name} already exists in {repo.working_tree_dir}; check it out, delete it, "
                    "or pass --branch NAME."
                )
            repo.git.checkout("-b", name)
        paths = _repo_paths(repo, target.root, plan.changes)
        written = False
        try:
            write_all(target.root, plan.changes, checked=True)
            written = True
            sha = _commit(repo, paths, _message("apply", target, sets, plan))
        except BaseException:
            if written:  # the commit failed: unstage and put every file back
                repo.git.reset("-q", "--", *paths)
                for change in plan.changes:
                    _write_one(target.root, change.path, change.before)
            if new_branch and original_branch:
                repo.git.checkout("-q", original_branch)
                repo.git.branch("-D", name)
            raise
        result["git"] = {"branch": repo.active_branch.name, "commit": sha, "from_branch": original_branch}
    else:
        write_all(target.root, plan.changes)
        _record_originals(target.root, plan)
        result["manifest"] = str(_manifest_path(target.root))
    return result


def revert(target: Target, sets: list[PatchSet]) -> dict[str, Any]:
    """Revert `sets`: files byte-identical to before the apply; on git a revert commit on the current branch."""
    _writable(target)
    plan = plan_revert(target, sets)
    result = _result(plan)
    if not plan.changes:
        return result
    repo = open_repo(target.root)
    if repo is not None:
        write_all(target.root, plan.changes)
        paths = _repo_paths(repo, target.root, plan.changes)
        known = set(repo.git.ls_files("--", *paths).splitlines())
        tracked = [p for p in paths if p in known]
        if tracked:
            sha = _commit(repo, tracked, _message("revert", target, sets, plan))
            result["git"] = {
                "branch": None if repo.head.is_detached else repo.active_branch.name,
                "commit": sha,
            }
    else:
        write_all(target.root, plan.changes)
        _forget_originals(target.root, plan)
    return result

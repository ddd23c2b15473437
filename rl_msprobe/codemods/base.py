"""What every codemod is: a pure `str -> str` edit of one upstream file, found by named anchors.

A codemod only *inserts whole lines*, each ending in its marker comment
(`# rl-msprobe:<name>`). That one rule makes the rest exact and content-based:
`revert` drops the marked lines (giving back the original bytes, line endings included),
`status` compares a file with what applying to its reverted self would give, and
`apply` is idempotent. Every `apply` checks the rule itself (black-style self-check).
"""

from __future__ import annotations

import ast
import enum
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NoReturn, TypeVar

import libcst as cst
from packaging.version import InvalidVersion, Version

from rl_msprobe.errors import UserError

MARKER_PREFIX = "# rl-msprobe:"


class Status(str, enum.Enum):
    """Where a file (or a set) stands with respect to a codemod."""

    APPLIED = "applied"
    ABSENT = "absent"
    PARTIAL = "partial"
    CONFLICT = "conflict"
    NOT_APPLICABLE = "not-applicable"  # the piece does not exist for this version / tree
    NATIVE = "native"  # the upstream version supports this natively: no patch needed
    NOT_COVERED = "not-covered"  # the code is in the tree, in a shape no site knows: only a guard line


@dataclass(frozen=True)
class StatusReport:
    status: Status
    detail: str = ""


class AnchorError(UserError):
    """A named anchor was not found: the upstream file differs from what the codemod knows."""

    def __init__(self, path: str, anchor: str, version: str | None, expected: str) -> None:
        self.path, self.anchor, self.version, self.expected = path, anchor, version, expected
        super().__init__(
            f"{path}: anchor '{anchor}' not found (detected version {version or 'unknown'}); "
            f"expected {expected}. The file differs from every release rl-msprobe knows: "
            "update rl-msprobe, or edit the file by hand following the diff of a supported release."
        )


def parse_version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def version_in_range(version: str | None, low: str | None, high: str | None) -> bool:
    """Inclusive range check on release numbers; post-releases of `high` count as inside.

    An unknown version is treated as inside: the anchors decide then.
    """
    parsed = parse_version(version)
    if parsed is None:
        return True
    if low is not None and parsed < Version(low):
        return False
    if high is None or parsed <= Version(high):
        return True
    # a post-release of the newest supported release (0.9.1.post1) is the same code
    return parsed.is_postrelease and Version(parsed.base_version) == Version(Version(high).base_version)


@functools.lru_cache(maxsize=16)
def _parsed(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _defines(node: ast.stmt, name: str) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name


def top_level_classes(source: str) -> dict[str, ast.ClassDef]:
    """The classes a module defines at top level (ast: a cheap look, no edit is made from it)."""
    module = _parsed(source)
    if module is None:
        return {}
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


class Codemod:
    """Base class. Subclasses set the class attributes and implement `transform`."""

    name: ClassVar[str]  # also the marker suffix
    project: ClassVar[str]
    path: ClassVar[str]  # relative to the tree root, posix
    anchors: ClassVar[dict[str, str]]  # anchor name -> what was expected there (for errors)
    # top-level classes, one of which the file must define for this codemod to apply there;
    # empty: the file's presence decides (then every required anchor must be found)
    subject: ClassVar[tuple[str, ...]] = ()
    # its cases, under fixtures/codemods/ in the repository (default: the codemod's name):
    # X.before.py + X.after.py per upstream shape, Y.invalid.py per drift it must refuse loudly;
    # tests/codemods/ runs every registered codemod over its own folder
    fixtures: ClassVar[str] = ""

    # the helper module's import the inserted lines use, put after the file's imports (None: none)
    helper_import: ClassVar[str | None] = None
    # environment switches that turn this codemod's lines on; where its code has no site, a guard
    # line makes that code fail when it runs with one of them set (needs the helper's not_covered)
    switches: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ for subclasses

    def transformer(self, ctx: TransformContext) -> cst.CSTTransformer:
        """The LibCST transformer that inserts this codemod's lines (it calls ctx.hit per anchor)."""
        raise NotImplementedError

    def after_visit(self, transformer: cst.CSTTransformer, ctx: TransformContext) -> None:
        """Hook: anchors that depend on what the visit found (waive the variants the file lacks)."""

    def transform(self, module: cst.Module, ctx: TransformContext) -> cst.Module:
        """Visit, check that every required anchor was found (in declaration order), then import
        the helper. A codemod overrides `transformer` (or, for something else, this)."""
        transformer = self.transformer(ctx)
        updated = module.visit(transformer)
        self.after_visit(transformer, ctx)
        ctx.check_all_found()
        if self.helper_import:
            updated = insert_after_imports(updated, [ctx.statement(self.helper_import)])
        return updated

    # ------------------------------------------------------------------ public API

    @property
    def marker(self) -> str:
        return f"{MARKER_PREFIX}{self.name}"

    @property
    def fixture_folder(self) -> str:
        """The folder of this codemod's cases, relative to fixtures/codemods/."""
        return self.fixtures or self.name

    def required_anchors(self) -> list[str]:
        """Every declared anchor; a transform waives the variants the file's code does not use."""
        return list(self.anchors)

    def present(self, source: str) -> bool:
        """Does this file hold what the codemod patches (its subject)? Shape, not version, decides."""
        if not self.subject:
            return True
        return any(name in top_level_classes(source) for name in self.subject)

    def subject_text(self) -> str:
        if not self.subject:
            return f"the file {self.path}"
        return " or ".join(f"class {name}" for name in self.subject)

    def apply(self, source: str, version: str | None = None) -> str:
        """Insert the marked lines; a source where they already stand comes back unchanged."""
        if self.is_marked(source):
            report = self.status(source, version)
            if report.status is Status.APPLIED:
                return source
            raise UserError(
                f"{self.path}: the {self.name} patch is {report.status.value} ({report.detail}); "
                f"run `rl-msprobe patch revert` first, then apply again."
            )
        return self._apply_clean(source, version)

    def revert(self, source: str) -> str:
        """Drop this codemod's marked lines: the exact original text."""
        return "".join(line for line in source.splitlines(keepends=True) if not self._is_marked_line(line))

    def status(self, source: str, version: str | None = None) -> StatusReport:
        marked = self.marked_lines(source)
        clean = self.revert(source)
        try:
            expected = self._apply_clean(clean, version)
        except AnchorError as exc:
            if not marked:
                return StatusReport(Status.CONFLICT, f"cannot be applied: anchor '{exc.anchor}' not found")
            return StatusReport(Status.CONFLICT, f"anchor '{exc.anchor}' changed after apply")
        if not marked:
            return StatusReport(Status.ABSENT, "not applied")
        if expected == source:
            return StatusReport(Status.APPLIED, f"{len(marked)} marked lines in place")
        wanted = self.marked_lines(expected)
        if len(marked) < len(wanted) and all(line in wanted for line in marked):
            return StatusReport(Status.PARTIAL, f"{len(marked)} of {len(wanted)} marked lines present")
        return StatusReport(Status.CONFLICT, "marked lines differ from what this version expects")

    def is_marked(self, source: str) -> bool:
        return self.marker in source and bool(self.marked_lines(source))

    def marked_lines(self, source: str) -> list[str]:
        return [line.strip() for line in source.splitlines() if self._is_marked_line(line)]

    def guard(self, source: str, error: AnchorError) -> str | None:
        """`source` plus a marked guard where this codemod's code has no site (`error`): after the class
        the anchors name, `<helper>.not_covered(Class, "method", name, reason, switches)` makes that
        method (or the class's __init__) raise when it runs with a switch set. None without a helper,
        switches, or a class of the anchors in the file."""
        if not self.helper_import or not self.switches:
            return None
        classes = top_level_classes(source)
        split = [a.split(".", 1) for a in (error.anchor, *self.anchors) if "." in a and " " not in a]
        named = [(cls, method) for cls, method in split if cls in classes]
        named += [(cls, "__init__") for cls in self.subject if cls in classes]
        defined = [(c, m) for c, m in named if any(_defines(n, m) for n in classes[c].body)]
        if not defined and not named:
            return None
        cls, method = defined[0] if defined else (named[0][0], "__init__")
        alias = self.helper_import.split()[-1]
        reason = f"anchor '{error.anchor}' not found (detected version {error.version or 'unknown'})"
        module = cst.parse_module(source)
        ctx = TransformContext(self, module, error.version)
        call = ctx.statement(
            f"{alias}.not_covered({cls}, {method!r}, {self.name!r}, {reason!r}, {tuple(self.switches)!r})"
        )
        body = list(module.body)
        index = next(
            i for i, stmt in enumerate(body) if isinstance(stmt, cst.ClassDef) and stmt.name.value == cls
        )
        module = module.with_changes(body=[*body[: index + 1], call, *body[index + 1 :]])
        result = insert_after_imports(module, [ctx.statement(self.helper_import)]).code
        if self.revert(result) != source:
            raise RuntimeError(f"codemod {self.name} changed unmarked text in {self.path}")
        return result

    def only_guarded(self, source: str) -> bool:
        """Are this codemod's marked lines in SOURCE (if any) only a guard line and its import?"""
        return all(
            ".not_covered(" in mark or mark.startswith(("from ", "import "))
            for mark in self.marked_lines(source)
        )

    def guarded(self, source: str, version: str | None) -> tuple[str, AnchorError] | None:
        """(the file with its guard, the anchor error) when SOURCE (applied or not) holds this codemod's
        code in a shape it has no site for and nothing else of it; None when it has a site or other marks."""
        clean = self.revert(source)
        try:
            self._apply_clean(clean, version)
        except AnchorError as exc:
            if self.only_guarded(source):
                return self.guard(clean, exc) or clean, exc
        return None

    # ------------------------------------------------------------------ internals

    def _is_marked_line(self, line: str) -> bool:
        return line.rstrip("\r\n").rstrip().endswith(self.marker)

    def _apply_clean(self, source: str, version: str | None) -> str:
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as exc:
            raise UserError(f"{self.path}: not valid Python ({exc.message} at line {exc.raw_line}).") from exc
        ctx = TransformContext(self, module, version)
        result = self.transform(module, ctx).code
        ctx.check_all_found()
        if self.revert(result) != source:  # self-check: only whole marked lines were added
            raise RuntimeError(f"codemod {self.name} changed unmarked text in {self.path}")
        return result


class TransformContext:
    """Per-run helper for a codemod: records anchors and builds marked statements."""

    def __init__(self, codemod: Codemod, module: cst.Module, version: str | None) -> None:
        self.codemod = codemod
        self.module = module
        self.version = version
        self.found: set[str] = set()
        self.waived: set[str] = set()

    def waive(self, anchor: str) -> None:
        """This file's code does not use the variant `anchor` stands for: it is not required here."""
        if anchor not in self.codemod.anchors:
            raise KeyError(f"{self.codemod.name}: undeclared anchor {anchor!r}")
        self.waived.add(anchor)

    def hit(self, anchor: str) -> None:
        if anchor not in self.codemod.anchors:
            raise KeyError(f"{self.codemod.name}: undeclared anchor {anchor!r}")
        self.found.add(anchor)

    def require(self, anchor: str) -> None:
        """Raise now if `anchor` was not found (for anchors that later steps depend on)."""
        if anchor not in self.found:
            self.fail(anchor)

    def fail(self, anchor: str) -> NoReturn:
        raise AnchorError(self.codemod.path, anchor, self.version, self.codemod.anchors[anchor])

    def check_all_found(self) -> None:
        for anchor in self.codemod.required_anchors():
            if anchor not in self.found and anchor not in self.waived:
                self.fail(anchor)

    def statements(self, code: str) -> list[cst.BaseStatement]:
        """Parse one or more one-line statements and mark each line."""
        lines = [line for line in code.strip("\n").split("\n") if line.strip()]
        newline = self.module.default_newline
        marked = "".join(f"{line}  {self.codemod.marker}{newline}" for line in lines)
        parsed = cst.parse_module(marked, config=self.module.config_for_parsing)
        return list(parsed.body)

    def statement(self, code: str) -> cst.BaseStatement:
        (stmt,) = self.statements(code)
        return stmt


# ---------------------------------------------------------------------- small CST helpers


def _block(node: cst.CSTNode) -> cst.IndentedBlock:
    body = getattr(node, "body", None)
    if isinstance(body, cst.IndentedBlock):
        return body
    raise TypeError(f"{type(node).__name__} has no indented block")


def body_of(node: cst.CSTNode) -> Sequence[cst.BaseStatement]:
    return _block(node).body


NodeT = TypeVar("NodeT", bound=cst.CSTNode)


def with_body(node: NodeT, statements: Iterable[cst.BaseStatement]) -> NodeT:
    return node.with_changes(body=_block(node).with_changes(body=tuple(statements)))


def is_import(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def insert_after_imports(module: cst.Module, statements: Sequence[cst.BaseStatement]) -> cst.Module:
    """Insert statements after the last top-level import of the leading import block."""
    body = list(module.body)
    last = -1
    for index, stmt in enumerate(body):
        if is_import(stmt):
            last = index
        elif last >= 0 and not isinstance(stmt, cst.SimpleStatementLine):
            break
    position = last + 1 if last >= 0 else _after_docstring(body)
    return module.with_changes(body=[*body[:position], *statements, *body[position:]])


def _after_docstring(body: Sequence[cst.BaseStatement]) -> int:
    if body and isinstance(body[0], cst.SimpleStatementLine):
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(
            first.value, (cst.SimpleString, cst.ConcatenatedString)
        ):
            return 1
    return 0


def call_name(node: cst.CSTNode) -> str | None:
    """Dotted name of a call's function (`self.forward_step`), else None."""
    if not isinstance(node, cst.Call):
        return None
    return dotted(node.func)


def dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def contains_call(node: cst.CSTNode, name: str) -> bool:
    """Does `node` contain a call to the dotted function `name` anywhere?"""
    found = False

    class _Finder(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> bool:
            nonlocal found
            if call_name(call) == name:
                found = True
            return not found

    node.visit(_Finder())
    return found


class ScopedTransformer(cst.CSTTransformer):
    """A transformer that knows the dotted class/function scope it is in (`FSDPEngine.forward_step`).

    `targets` (qualnames) prunes the walk: classes and functions on no target's path are not
    entered, which keeps a codemod close to the cost of parsing the file (most of an upstream
    file is code the codemod never touches). Empty: every scope is entered.
    """

    targets: tuple[str, ...] = ()

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.scope: list[str] = []

    @property
    def qualname(self) -> str:
        return ".".join(self.scope)

    def _wanted(self) -> bool:
        if not self.targets:
            return True
        here = self.qualname
        return any(t == here or t.startswith(here + ".") or here.startswith(t + ".") for t in self.targets)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.scope.append(node.name.value)
        return self._wanted()

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.BaseStatement:
        self.scope.pop()
        return self.leave_scope(original, updated)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.scope.append(node.name.value)
        return self._wanted()

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.BaseStatement:
        name = self.qualname
        self.scope.pop()
        return self.leave_function(name, original, updated)

    def leave_scope(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.BaseStatement:
        return updated

    def leave_function(
        self, qualname: str, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.BaseStatement:
        return updated


def insert_before(stmt: cst.BaseStatement, new: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """`new` then `stmt`, with `stmt`'s leading blank lines and comments moved above `new`.

    The text is the same after a revert (the marked lines go, the leading lines stay).
    """
    if not new:
        return [stmt]
    lead = getattr(stmt, "leading_lines", ())
    first = new[0].with_changes(leading_lines=lead)
    return [first, *new[1:], stmt.with_changes(leading_lines=())]


class MethodBlockTransformer(ScopedTransformer):
    """Rewrites the statement blocks of one method (`Class.method`), hitting the method's anchor.

    Subclasses implement `rewrite(statements)`; blocks outside the method are left alone.
    The method's anchor must be declared under the method's qualname.
    """

    def __init__(self, ctx: TransformContext, method: str) -> None:
        super().__init__(ctx)
        self.method = method
        self.targets = (method,)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        wanted = super().visit_FunctionDef(node)
        if self.qualname == self.method:
            self.ctx.hit(self.method)
        return wanted

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.BaseSuite:
        if self.qualname != self.method:
            return updated
        return updated.with_changes(body=self.rewrite(updated.body))

    def rewrite(self, statements: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        raise NotImplementedError


def after_docstring(statements: Sequence[cst.BaseStatement]) -> int:
    """Index of the first statement after a function's docstring."""
    return _after_docstring(list(statements))

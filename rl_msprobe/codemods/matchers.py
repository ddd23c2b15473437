"""Matcher builders over `libcst.matchers`: the statement shapes codemods anchor on, said once.

`one_line(small)` is a statement line holding exactly one small statement; `assigns(name, value)`
is `name = value` or `name: T = value` on such a line; `calls(dotted)` a call of a dotted name;
`containing(matcher)` any node with such a node inside it. `saves()` marks the place of a name
a codemod needs back (the batch a statement measures, the variable a call's result goes to) and
`saved_name(statement, matcher)` returns it. Codemods combine them with `|` / `&`
and test nodes with `libcst.matchers.matches`.
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

Matcher = m.BaseMatcherNode
SmallMatcher = m.BaseSmallStatement | m.OneOf[m.BaseSmallStatement]  # what one_line holds


def name(dotted_name: str) -> m.Name | m.Attribute:
    """`a` or `a.b.c` as a Name / Attribute matcher."""
    *base, last = dotted_name.split(".")
    if not base:
        return m.Name(last)
    return m.Attribute(value=name(".".join(base)), attr=m.Name(last))


def calls(dotted_name: str) -> m.Call:
    """A call of `dotted_name` (`self.actor_rollout_wg.compute_log_prob(...)`), any arguments;
    `super().generate` is a call of the parent's method (`super(...)` with any arguments)."""
    base, _, last = dotted_name.rpartition(".")
    if base == "super()":
        return m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name(last)))
    return m.Call(func=name(dotted_name))


def awaits(dotted_name: str) -> m.Await:
    """`await dotted_name(...)`."""
    return m.Await(expression=calls(dotted_name))


def _dotted(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) or (isinstance(node, cst.Attribute) and _dotted(node.value))


DOTTED = m.MatchIfTrue(_dotted)  # any `a` / `a.b.c`, whatever the names


SAVED = "saved"


def saves(inner: m.Name | None = None) -> Any:  # libcst types SaveMatchedNode as a function
    """`inner` (default: any node), remembered: `saved_name` hands back the name found at this place."""
    return m.SaveMatchedNode(inner if inner is not None else m.DoNotCare(), SAVED)


def saved_name(node: cst.CSTNode, matcher: Matcher) -> str | None:
    """The name `matcher` saved (see `saves`) when `node` matches it: a Name's value, or a tuple's
    first Name (`x, y = ...` -> x); else None."""
    found = m.extract(node, matcher)
    saved = found.get(SAVED) if found else None
    if isinstance(saved, cst.Tuple) and saved.elements:
        saved = saved.elements[0].value
    return saved.value if isinstance(saved, cst.Name) else None


def one_line(small: SmallMatcher) -> m.SimpleStatementLine:
    """A statement line that is exactly one small statement (no `;`)."""
    return m.SimpleStatementLine(body=[small])


ANY = m.DoNotCare()


def assigns(target: str, value: m.BaseExpression | m.DoNotCareSentinel = ANY) -> m.SimpleStatementLine:
    """`target = value` or `target: T = value`, alone on its line (`target` dotted)."""
    return one_line(
        m.Assign(targets=[m.AssignTarget(target=name(target))], value=value)
        | m.AnnAssign(target=name(target), value=value)
    )


def containing(inner: Matcher) -> m.MatchIfTrue[cst.CSTNode]:
    """Any node with a node matching `inner` somewhere inside it."""

    def holds(node: cst.CSTNode) -> bool:
        return bool(m.findall(node, inner))

    return m.MatchIfTrue(holds)


def method(module: cst.Module, qualname: str) -> cst.FunctionDef | None:
    """The method `Class.method` defined in a top-level class of `module`, else None."""
    cls, _, func = qualname.partition(".")
    for stmt in module.body:
        if m.matches(stmt, m.ClassDef(name=m.Name(cls), body=m.IndentedBlock())):
            for item in cst.ensure_type(stmt, cst.ClassDef).body.body:
                if isinstance(item, cst.FunctionDef) and item.name.value == func:
                    return item
    return None

"""Matcher builders over `libcst.matchers`: the statement shapes codemods anchor on, said once.

`one_line(small)` is a statement line holding exactly one small statement; `assigns(name, value)`
is `name = value` or `name: T = value` on such a line; `calls(dotted)` a call of a dotted name;
`containing(matcher)` any node with such a node inside it. Codemods combine them with `|` / `&`
and test nodes with `libcst.matchers.matches`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

Matcher = m.BaseMatcherNode


def name(dotted_name: str) -> Matcher:
    """`a` or `a.b.c` as a Name / Attribute matcher."""
    *base, last = dotted_name.split(".")
    if not base:
        return m.Name(last)
    return m.Attribute(value=name(".".join(base)), attr=m.Name(last))


def calls(dotted_name: str) -> Matcher:
    """A call of `dotted_name` (`self.actor_rollout_wg.compute_log_prob(...)`), any arguments."""
    return m.Call(func=name(dotted_name))


def one_line(small: Matcher) -> Matcher:
    """A statement line that is exactly one small statement (no `;`)."""
    return m.SimpleStatementLine(body=[small])


ANY = m.DoNotCare()


def assigns(target: str, value: Matcher | m.DoNotCareSentinel = ANY) -> Matcher:
    """`target = value` or `target: T = value`, alone on its line (`target` dotted)."""
    return one_line(
        m.Assign(targets=[m.AssignTarget(target=name(target))], value=value)
        | m.AnnAssign(target=name(target), value=value)
    )


def containing(inner: Matcher) -> Matcher:
    """Any node with a node matching `inner` somewhere inside it."""
    return m.MatchIfTrue(lambda node: bool(m.findall(node, inner)))


def method(module: cst.Module, qualname: str) -> cst.FunctionDef | None:
    """The method `Class.method` defined in a top-level class of `module`, else None."""
    cls, _, func = qualname.partition(".")
    for stmt in module.body:
        if m.matches(stmt, m.ClassDef(name=m.Name(cls))):
            for item in stmt.body.body:  # type: ignore[attr-defined]
                if isinstance(item, cst.FunctionDef) and item.name.value == func:
                    return item
    return None

"""The import rules of docs/architecture.md, read from the source with `ast` (nothing imported):
the packages import one another without a cycle, lazy imports included; no module imports another
at import time in a cycle; no module takes a private (`_name`) name from another module, nor does
a test; and the helpers under rl_msprobe/patches/files, which run inside verl / vLLM / SGLang,
import nothing of rl_msprobe."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "rl_msprobe"
FILES = SOURCE / "patches" / "files"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(SOURCE.rglob("*.py")) if FILES not in p.parents}


def _package(module: str) -> str:
    """rl_msprobe.engine.plan -> engine; rl_msprobe.cli -> cli (a top-level module is its own)."""
    return module.split(".")[1] if "." in module else module


def _imports(module: str, at_import_time: bool) -> list[tuple[str, str]]:
    """(imported module, imported name or '') for every rl_msprobe import of MODULE; with
    AT_IMPORT_TIME only those that run when it is imported (not in a function, not TYPE_CHECKING)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if at_import_time:
        nodes: list[ast.stmt] = []
        todo = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo += node.orelse
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
            else:
                nodes.append(node)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "rl_msprobe"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base.split(".")[0] == "rl_msprobe":
                found += [
                    (f"{base}.{a.name}", "") if f"{base}.{a.name}" in MODULES else (base, a.name)
                    for a in node.names
                ]
    return found


def _graph(at_import_time: bool, key=lambda m: m) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _ in _imports(module, at_import_time):
            if target in MODULES and key(target) != key(module):
                graph.setdefault(key(module), set()).add(key(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        return list(e.args[1])
    return []


def test_the_packages_import_one_another_without_a_cycle():
    cycle = _cycle(_graph(at_import_time=False, key=_package))
    assert not cycle, f"packages in a cycle (lazy imports counted): {' -> '.join(cycle)}"


def test_no_module_imports_another_in_a_cycle_at_import_time():
    cycle = _cycle(_graph(at_import_time=True))
    assert not cycle, f"modules in an import-time cycle: {' -> '.join(cycle)}"


def test_no_private_name_crosses_a_module():
    """A `_name` is its module's own: one shared by two modules is public (or lives in a module
    both import), in the same package as across packages."""
    crossing = [
        f"{module} imports {name} from {target}"
        for module in MODULES
        for target, name in _imports(module, at_import_time=False)
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not crossing, "make these public (or move them):\n" + "\n".join(crossing)


def test_no_test_takes_a_private_name_of_rl_msprobe():
    """Tests call what the modules offer: a helper worth its own test is public."""
    taking = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rl_msprobe"
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not taking, "make these public (or test through a public name):\n" + "\n".join(taking)


def test_the_injected_helpers_import_nothing_of_rl_msprobe():
    helpers = sorted(FILES.rglob("*.py"))
    assert len(helpers) >= 8
    importing = [
        str(p.relative_to(ROOT))
        for p in helpers
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rl_msprobe")
        or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "rl_msprobe" for a in node.names))
    ]
    assert not importing, (
        f"these run inside upstream processes, where rl_msprobe is not installed: {importing}"
    )


def test_the_checks_see_a_cycle_and_a_lazy_import():
    assert _cycle({"a": {"b"}, "b": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert not _cycle({"a": {"b"}, "b": set()})
    # the planner imports the modes lazily: seen with lazy imports, not at import time
    lazy = {t for t, _ in _imports("rl_msprobe.commands.planner", at_import_time=False)}
    eager = {t for t, _ in _imports("rl_msprobe.commands.planner", at_import_time=True)}
    assert eager < lazy

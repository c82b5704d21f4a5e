#!/usr/bin/env python3
"""Fail when the packages' imports form a circle; name every circle found.

The graph is built from the source with ``ast`` (nothing is imported). Every import that can run
counts, at module level or inside a function: deferring an import into a function hides a circle
from the interpreter but does not remove it (``api`` and ``verify`` once imported each other that
way). Imports under ``if TYPE_CHECKING:`` never run and do not count. ``from pkg import name`` is
an edge to ``pkg.name`` when that is a module of the tree, else to ``pkg`` itself. The implicit
import of a parent package's ``__init__`` is not an edge: Python finds the package already in
``sys.modules`` by then, and every module would otherwise sit in a circle with an ``__init__``
that re-exports it.

Usage: ``python tools/import_cycles.py [PACKAGE_DIR ...]`` (default: ckptconv nxdtrain, relative to
the repository root). Exit status 1 and one line per circle (``a -> b -> a``) when there is one.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

DEFAULT_PACKAGES = ("ckptconv", "nxdtrain")


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under ``package_dir`` (the package's own name first)."""
    root = package_dir.parent
    out: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(body: Iterable[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``body`` and the blocks nested in it, except under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    yield from _runtime_imports([child] if isinstance(child, ast.stmt) else child.body)


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute package/module a ``from ... import`` names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (at load time or later)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve_from(name, is_package, node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the packages are small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle_in(graph, set(c)) for c in sorted(components, key=min)]


def _circle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (by name), found breadth-first."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in a strongly connected component: {sorted(component)}")


def check(package_dirs: Iterable[Path]) -> list[str]:
    """The circles among the packages' modules, one ``a -> b -> a`` line each (empty: none)."""
    modules: dict[str, Path] = {}
    for package_dir in package_dirs:
        modules.update(module_files(package_dir))
    return [" -> ".join(c) for c in find_cycles(import_graph(modules))]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    repo = Path(__file__).resolve().parent.parent
    dirs = [Path(a) for a in args] or [repo / p for p in DEFAULT_PACKAGES]
    cycles = check(dirs)
    for line in cycles:
        print(f"import circle: {line}", file=sys.stderr)
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())

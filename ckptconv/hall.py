"""The ground floor every room stands on: the package's version and the lazy exports of a room's ``__init__``.

It imports nothing of the package, so a room's ``__init__`` (and ``ckptconv.io.metadata``, which records the version)
never runs back up to the package root and its verbs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__version__ = "0.2.0"  # the one place: pyproject.toml's version is read from here (tool.setuptools.dynamic)


def lazy_exports(package: str, init_file: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package's ``__init__`` (a room's, and both packages' own): its public names are what it imports under
    ``if TYPE_CHECKING:`` (so type checkers see each name's real type), imported on first use, so that
    importing one module of the room never imports the whole room (``--help`` stays free of torch).

    >>> from ckptconv.core import ParallelLayout  # ckptconv.core.layout imported here, not before
    """
    table: dict[str, tuple[str, str]] = {}

    def __getattr__(name: str) -> Any:
        if not table:
            table.update(type_checking_imports(Path(init_file)))
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = table[name]
        import importlib

        value = importlib.import_module(f"{package}.{attr}") if module == package else getattr(
            importlib.import_module(module), attr)
        setattr(sys.modules[package], name, value)  # the next lookup is an ordinary attribute
        return value

    return __getattr__


def type_checking_imports(init_file: Path) -> dict[str, tuple[str, str]]:
    """Exported name -> (module, attribute) for every ``from M import A [as N]`` under the file's top-level
    ``if TYPE_CHECKING:``."""
    import ast

    out: dict[str, tuple[str, str]] = {}
    for node in ast.parse(init_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    out.update({a.asname or a.name: (stmt.module, a.name) for a in stmt.names})
    return out

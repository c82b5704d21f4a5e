"""ckptconv: HF (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE) <-> NxD tp x pp x ep shards <-> TorchTitan DCP, streamed, verified.

The public API is a handful of verbs; everything the CLI does is one of these calls:
``to_nxd``, ``to_hf``, ``reshard``, ``inspect``, ``to_dcp``, ``from_dcp`` (imported lazily, so that importing a submodule
such as ``ckptconv.core.mapping`` stays cheap).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.errors import ConversionError, VerificationError

if TYPE_CHECKING:  # the verbs, imported on first use (lazy_exports below)
    from ckptconv.commands.api import reshard, to_hf, to_nxd
    from ckptconv.commands.dcp import from_dcp, to_dcp
    from ckptconv.commands.inspect import inspect
    from ckptconv.engine.options import RunOptions

__version__ = "0.2.0"  # the one place: pyproject.toml's version is read from here (tool.setuptools.dynamic)

__all__ = ["ConversionError", "VerificationError", "__version__", "RunOptions", "to_nxd", "to_hf", "reshard",
           "inspect", "to_dcp", "from_dcp"]


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


__getattr__ = lazy_exports(__name__, __file__)

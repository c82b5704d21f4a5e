"""Small modules and functions (docs/architecture.md; style habit 10): no module of ckptconv/ or nxdtrain/ over
600 lines, no function over 80, each offender named with its size."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ckptconv", "nxdtrain")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def long_modules(paths: list[Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` of every module over ``limit`` lines."""
    out = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append(f"{path.relative_to(REPO)}: {lines} lines")
    return out


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``path::name`` -> lines (decorators not counted, its docstring counted) of every function or method over
    ``limit`` lines, nested ones included."""
    out = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out[f"{path.relative_to(REPO).as_posix()}::{node.name}"] = lines
    return out


def test_no_module_is_over_600_lines():
    assert long_modules(_modules()) == []


def test_no_function_is_over_80_lines():
    offenders = long_functions(_modules())
    assert [f"{name}: {lines} lines" for name, lines in sorted(offenders.items())] == []


def test_an_offender_is_named_with_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    module = tmp_path / "pkg" / "big.py"
    module.parent.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    module.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions([module]) == {"pkg/big.py::long": 81}
    assert long_modules([module], limit=84) == ["pkg/big.py: 85 lines"]
    assert long_modules([module]) == []

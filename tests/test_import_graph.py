"""The import graph: no circles in either package (tools/import_cycles.py), and ``io/`` below the executor."""

from __future__ import annotations

import ast
import functools
import importlib.util
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_cycles", REPO / "tools" / "import_cycles.py")
assert _spec is not None and _spec.loader is not None
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(textwrap.dedent(text))
    return pkg


def test_the_tree_has_no_import_circle():
    assert import_cycles.check([REPO / "ckptconv", REPO / "nxdtrain"]) == []


def test_a_planted_module_level_circle_is_named(tmp_path, capsys):
    pkg = _package(tmp_path, {"a.py": "from pkg import b\n", "b.py": "import pkg.c\n", "c.py": "from pkg.a import x\n",
                              "d.py": "import pkg.a\n"})
    assert import_cycles.check([pkg]) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a"]
    assert import_cycles.main([str(pkg)]) == 1
    assert capsys.readouterr().err == "import circle: pkg.a -> pkg.b -> pkg.c -> pkg.a\n"


def test_an_import_deferred_into_a_function_still_closes_a_circle(tmp_path):
    pkg = _package(tmp_path, {
        "api.py": "from .verify import verify\n",
        "verify.py": """
            import os

            def verify():
                try:
                    from .api import open_nxd
                except ImportError:
                    pass
            """,
    })
    assert import_cycles.check([pkg]) == ["pkg.api -> pkg.verify -> pkg.api"]


def test_type_checking_imports_do_not_count_but_their_else_branch_does(tmp_path):
    typed = {"layers.py": "from pkg.sub.seq import gather\n",
             "sub/__init__.py": "",
             "sub/seq.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..layers import Group\n"}
    assert import_cycles.check([_package(tmp_path / "one", typed)]) == []
    typed["sub/seq.py"] += "else:\n    from .. import layers\n"
    assert import_cycles.check([_package(tmp_path / "two", typed)]) == ["pkg.layers -> pkg.sub.seq -> pkg.layers"]


def test_a_name_reexported_by_a_package_init_is_an_edge_to_the_init(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "from pkg.core import run\n", "core.py": "from pkg import VERSION\n"})
    assert import_cycles.check([pkg]) == ["pkg -> pkg.core -> pkg"]
    pkg = _package(tmp_path / "fine", {"__init__.py": "from pkg.core import run\n", "core.py": "from pkg import util\n",
                                       "util.py": ""})
    assert import_cycles.check([pkg]) == []


@functools.cache
def _ckptconv_graph() -> dict[str, set[str]]:
    return import_cycles.import_graph(import_cycles.module_files(REPO / "ckptconv"))


@pytest.mark.parametrize("name", sorted(m for m in import_cycles.module_files(REPO / "ckptconv")
                                        if m.startswith("ckptconv.io.")))
def test_io_builds_only_on_the_core_and_the_hall(name):
    """io/ is a leaf over the pure core: never the executor, the owner of OUT, or a verb."""
    graph = _ckptconv_graph()
    outside = {m for m in graph[name] if not m.startswith("ckptconv.io")}
    assert {m for m in outside if m not in HALL and not m.startswith("ckptconv.core.")} == set(), name
    if name == "ckptconv.io.atomic":
        assert outside == {"ckptconv.errors"}


def test_benchmarks_import_nothing_from_tests():
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m == "tests" or m.startswith("tests.")], path.name


# The floor plan (docs/architecture.md): the rooms of ckptconv, each a sub-package, and the rooms each may import.
# ``ckptconv.errors`` and the package root (its version, the lazy verbs) are the hall every room uses.
ROOMS_MAY_IMPORT = {
    "core": set(),
    "io": {"core"},
    "engine": {"core", "io"},
    "training": {"core", "io", "engine"},
    "sources": {"core", "io", "engine", "training"},  # a training tag is a source: its masters can be its weights
    "titan": {"core", "io", "engine", "training", "sources"},
    "commands": {"core", "io", "engine", "training", "sources", "titan"},
    "cli": {"core", "io", "engine", "training", "sources", "titan", "commands"},
}
HALL = {"ckptconv", "ckptconv.errors", "ckptconv.hall"}


def _room(module: str, rooms: dict[str, set[str]] = ROOMS_MAY_IMPORT, top: str | None = None) -> str | None:
    """The room of a module (``ckptconv.core.plan`` -> ``core``); ``top`` for a top-level module when given (nxdtrain's
    trainer); None for the hall and unplaced modules."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in rooms:
        return parts[1]
    return top if len(parts) == 2 else None


def layering_violations(graph: dict[str, set[str]], rooms: dict[str, set[str]] = ROOMS_MAY_IMPORT,
                        hall: set[str] = HALL, top: str | None = None) -> list[str]:
    """``a -> b`` for every import of a placed module that its room may not make (the hall imports no room)."""
    out = []
    for name, targets in sorted(graph.items()):
        room = "hall" if name in hall else _room(name, rooms, top)
        if room is None:
            continue
        for target in sorted(targets - hall):
            other = _room(target, rooms, top)
            if other is not None and other != room and (room == "hall" or other not in rooms[room]):
                out.append(f"{name} ({room}) -> {target} ({other})")
    return out


def test_each_room_imports_only_the_rooms_below_it():
    assert layering_violations(_ckptconv_graph()) == []


def test_a_planted_upward_import_is_named():
    graph = {"ckptconv.core.plan": {"ckptconv.engine.execute", "ckptconv.errors"},
             "ckptconv.engine.execute": {"ckptconv.core.plan"}, "ckptconv.errors": set()}
    assert layering_violations(graph) == ["ckptconv.core.plan (core) -> ckptconv.engine.execute (engine)"]


def test_every_module_sits_in_a_room():
    loose = [m for m in _ckptconv_graph() if m not in HALL and _room(m) is None]
    assert loose == []


# nxdtrain's floor plan (docs/architecture.md): the run's configuration at the bottom, then how the work is split and
# the data, the model a rank trains, checkpoints; the trainer's top-level modules (train, optim, metrics, plots, the CLI)
# may import every room and no room imports them. The hall: the root, the error, the device a run computes on.
NXDTRAIN_ROOMS_MAY_IMPORT = {
    "config": set(),
    "parallel": {"config"},
    "data": {"config"},
    "model": {"config", "parallel", "data"},
    "checkpoint": {"config", "parallel", "data", "model"},
    "trainer": {"config", "parallel", "data", "model", "checkpoint"},
}
NXDTRAIN_HALL = {"nxdtrain", "nxdtrain.errors", "nxdtrain.device"}
NXDTRAIN_TOP_LEVEL_MAX = 9  # modules at nxdtrain's top level, __init__ and the hall included


@functools.cache
def _nxdtrain_graph() -> dict[str, set[str]]:
    return import_cycles.import_graph(import_cycles.module_files(REPO / "nxdtrain"))


def test_each_nxdtrain_room_imports_only_the_rooms_below_it():
    assert layering_violations(_nxdtrain_graph(), NXDTRAIN_ROOMS_MAY_IMPORT, NXDTRAIN_HALL, top="trainer") == []


def test_a_planted_upward_import_of_nxdtrain_is_named():
    graph = {"nxdtrain.parallel.pipeline": {"nxdtrain.model.stage", "nxdtrain.errors"},
             "nxdtrain.errors": {"nxdtrain.train"}, "nxdtrain.model.stage": set(), "nxdtrain.train": set()}
    assert layering_violations(graph, NXDTRAIN_ROOMS_MAY_IMPORT, NXDTRAIN_HALL, top="trainer") == [
        "nxdtrain.errors (hall) -> nxdtrain.train (trainer)",
        "nxdtrain.parallel.pipeline (parallel) -> nxdtrain.model.stage (model)"]


def test_nxdtrain_s_top_level_is_small():
    top = sorted(path.name for path in (REPO / "nxdtrain").glob("*.py"))
    assert len(top) <= NXDTRAIN_TOP_LEVEL_MAX, top


def test_nxdtrain_s_rooms_word_their_own_errors():
    """No room of nxdtrain enters the converter's CLI (the hall's errors.py words a failed process's line)."""
    rooms = [path for room in NXDTRAIN_ROOMS_MAY_IMPORT for path in sorted((REPO / "nxdtrain" / room).rglob("*.py"))]
    assert [str(p.relative_to(REPO)) for p in rooms if any(m == "ckptconv.cli" for m, _ in _ckptconv_imports_of(p))] == []


def test_ckptconv_never_imports_nxdtrain():
    for path in sorted((REPO / "ckptconv").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] == "nxdtrain"], path


# nxdtrain enters ckptconv through the package root (the verbs), the hall, and each room's ``__init__``: the names a
# room exports under ``if TYPE_CHECKING:`` (ckptconv.lazy_exports). Never through a room's inner modules.
ENTRY_POINTS = {"ckptconv", "ckptconv.errors", "ckptconv.core", "ckptconv.io", "ckptconv.engine", "ckptconv.sources",
                "ckptconv.training", "ckptconv.cli"}


def _ckptconv_imports_of(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ckptconv import in a file (name "" for ``import M``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ckptconv":
            out += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "ckptconv"]
    return out


def test_nxdtrain_enters_ckptconv_through_the_entry_points_only():
    inner = [f"{path.relative_to(REPO)}: {module}" for path in sorted((REPO / "nxdtrain").rglob("*.py"))
             for module, _ in _ckptconv_imports_of(path) if module not in ENTRY_POINTS]
    assert inner == []


# (nxdtrain's root is not here: its ``train`` is also the name of its module nxdtrain.train, which shadows it once
# imported; the lazy export cannot win that race, as the dict it replaces could not.)
@pytest.mark.parametrize("room", sorted(ENTRY_POINTS - {"ckptconv.errors"}))
def test_every_export_of_a_room_is_its_module_s_object(room):
    import importlib

    from ckptconv import type_checking_imports

    package = importlib.import_module(room)
    exports = type_checking_imports(Path(package.__file__))
    assert exports, f"{room} exports nothing"
    for name, (module, attr) in exports.items():
        expected = importlib.import_module(f"{room}.{attr}") if module == room else getattr(
            importlib.import_module(module), attr)
        assert getattr(package, name) is expected, (room, name)


@pytest.mark.parametrize("package,hall", [("ckptconv", {"ConversionError", "VerificationError", "__version__"}),
                                          ("nxdtrain", {"TrainError"})])
def test_a_package_s_all_is_its_hall_and_its_lazy_exports(package, hall):
    import importlib

    from ckptconv import type_checking_imports

    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(hall | set(type_checking_imports(Path(module.__file__))))


def test_nxdtrain_uses_only_names_the_rooms_export():
    import importlib

    from ckptconv import type_checking_imports

    exported = {room: set(type_checking_imports(Path(importlib.import_module(room).__file__)))
                for room in ENTRY_POINTS - {"ckptconv", "ckptconv.errors"}}
    used = {(module, name) for path in (REPO / "nxdtrain").rglob("*.py") for module, name in _ckptconv_imports_of(path)
            if module in exported}
    assert {f"{module}.{name}" for module, name in used if name not in exported[module]} == set()


def test_an_unknown_name_of_a_room_is_an_attribute_error():
    import ckptconv.core

    with pytest.raises(AttributeError, match="module 'ckptconv.core' has no attribute 'plan_everything'"):
        ckptconv.core.plan_everything  # noqa: B018


def test_a_room_package_imports_none_of_its_modules_until_asked(tmp_path):
    import subprocess
    import sys

    probe = ("import sys, ckptconv.core, ckptconv.training, ckptconv.io; "
             "print(sorted(m for m in sys.modules if m.startswith('ckptconv.') and m.count('.') > 1), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[] False"


def test_no_module_imports_the_package_root():
    """A room's ``__init__`` and every module take the version and ``lazy_exports`` from the ground floor
    (``ckptconv.hall``): no import runs back up to the package root and its verbs."""
    assert sorted(m for m, targets in _ckptconv_graph().items() if "ckptconv" in targets and m != "ckptconv") == []

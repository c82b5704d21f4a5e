"""Make NxD 2.28's training code importable on XLA:CPU without the Neuron compiler or runtime.

What is stood in, and why (the same list as ``fixtures/nxdt-official/README.md`` → "Stand-ins"):

- ``neuronxcc.*`` and ``torch_neuronx.*`` are not installable here. Every module under them is made on
  import; every name in them is a placeholder that raises when it is used (called, compared, iterated).
  Three names NxD calls at import time get small substitutes: ``get_platform_target()`` returns ``"trn1"``,
  ``nki_jit(...)`` returns a decorator that yields a placeholder, and ``CollectivesConfig`` keeps only the
  context-parallel ring pairs ``parallel_state`` records (context parallel size is 1 here; nothing reads them).
- ``neuronx_distributed/__init__.py`` is not executed (it imports the NKI kernels and the tracing code): the
  package is registered with its source directory as its path, so its submodules import straight from there.
- torch-xla 2.9 no longer defines ``xla_env_vars.HOST_WORLD_SIZE``, which NxD's ``get_local_world_size()``
  reads off Neuron; it is added back with ``HOST_WORLD_SIZE=1`` (one host).
- The example's ``training_utils.py`` imports ``datasets`` only to load data sets: an empty module stands in
  while it is imported (``import_example``).

Nothing here touches NxD's checkpoint, optimizer or model code: those run as fetched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

FAKED_ROOTS = ("neuronxcc", "torch_neuronx")


class Placeholder:
    """A name from a Neuron-only package: fine to import and to pass around, an error to use."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __getitem__(self, key: object) -> Placeholder:  # type annotations such as nt.tensor[...]
        return Placeholder(f"{self._name}[...]")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"stand-in {self._name} was called: a Neuron-only code path ran on XLA:CPU")

    def __mro_entries__(self, bases: tuple) -> tuple:  # a placeholder used as a base class
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _placeholder_jit(*args: object, **kwargs: object) -> object:
    """``nki_jit`` / ``nki.jit``: used as ``@nki_jit()`` or ``@nki_jit`` at import time; the kernel is never run."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return Placeholder(getattr(args[0], "__qualname__", "kernel"))
    return lambda fn: Placeholder(getattr(fn, "__qualname__", "kernel"))


class CollectivesConfig:
    """Only what ``parallel_state`` reads: for each rank, its (source, target) in its ring."""

    def __init__(self, replica_groups: list[list[int]], **unused: object) -> None:
        self.rank_src_tgt_pairs: dict[int, tuple[int, int]] = {}
        for group in replica_groups:
            for i, rank in enumerate(group):
                self.rank_src_tgt_pairs[rank] = (group[i - 1], group[(i + 1) % len(group)])


SUBSTITUTES: dict[str, object] = {
    "torch_neuronx.utils.get_platform_target": lambda *a, **k: "trn1",
    "torch_neuronx.utils.utils.get_platform_target": lambda *a, **k: "trn1",
    "torch_neuronx.xla_impl.ops.nki_jit": _placeholder_jit,
    "neuronxcc.nki.jit": _placeholder_jit,
    "neuronxcc.nki._private_kernels.collectives.CollectivesConfig": CollectivesConfig,
    "neuronxcc.nki._pre_prod_kernels.collectives.CollectivesConfig": CollectivesConfig,
}


class _FakeModule(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        return SUBSTITUTES.get(full, Placeholder(full))


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import under ``FAKED_ROOTS`` with an empty package whose names are placeholders."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in FAKED_ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _FakeModule(spec.name)
        module.__path__ = []  # a package: submodules come from this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(nxd_src: Path) -> None:
    """Register the stand-ins, then NxD's ``neuronx_distributed`` package (source tree ``nxd_src``) uninitialised.

    ``nxd_src`` is the root of an extracted neuronx-distributed tree (it holds ``src/neuronx_distributed`` and
    ``examples/training/llama``). The example directory goes on ``sys.path`` so its modules import by their names.
    """
    package_dir = nxd_src / "src" / "neuronx_distributed"
    example_dir = nxd_src / "examples" / "training" / "llama"
    for needed in (package_dir / "trainer" / "checkpoint.py", example_dir / "modeling_llama_nxd.py"):
        if not needed.is_file():
            raise SystemExit(f"--nxd-src {nxd_src}: expected {needed} (an extracted neuronx-distributed v2.28.0)")
    if not any(isinstance(f, _FakeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FakeFinder())

    import torch_xla.core.xla_env_vars as xenv  # after the finder; torch_xla itself is real

    if not hasattr(xenv, "HOST_WORLD_SIZE"):
        xenv.HOST_WORLD_SIZE = "HOST_WORLD_SIZE"
    os.environ.setdefault("HOST_WORLD_SIZE", "1")

    package = types.ModuleType("neuronx_distributed")
    package.__path__ = [str(package_dir)]
    package.__file__ = str(package_dir / "__init__.py")  # for tools that print it; never executed
    sys.modules.setdefault("neuronx_distributed", package)
    if str(example_dir) not in sys.path:
        sys.path.insert(0, str(example_dir))


def import_example(name: str) -> types.ModuleType:
    """Import a module of NxD's Llama example (``training_utils``, ``lr``, ``modeling_llama_nxd``) unmodified."""
    import importlib

    if name in sys.modules:
        return sys.modules[name]
    real = sys.modules.get("datasets")
    sys.modules["datasets"] = types.ModuleType("datasets")  # training_utils uses it only to load data sets
    try:
        return importlib.import_module(name)
    finally:
        if real is None:
            del sys.modules["datasets"]
        else:
            sys.modules["datasets"] = real

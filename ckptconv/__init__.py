"""ckptconv: HF Llama (safetensors) <-> NxD tensor x pipeline parallel shards <-> TorchTitan DCP, streaming and verified.

The public API is a handful of verbs; everything the CLI does is one of these calls:
``to_nxd``, ``to_hf``, ``reshard``, ``inspect``, ``to_dcp``, ``from_dcp`` (imported lazily, so that importing a submodule
such as ``ckptconv.core.mapping`` stays cheap).
"""

from __future__ import annotations

from typing import Any

from ckptconv.errors import ConversionError, VerificationError

__version__ = "0.2.0"  # the one place: pyproject.toml's version is read from here (tool.setuptools.dynamic)

_API = {"RunOptions": "ckptconv.engine.options", "to_nxd": "ckptconv.commands.api", "to_hf": "ckptconv.commands.api",
        "reshard": "ckptconv.commands.api", "inspect": "ckptconv.commands.inspect",
        "to_dcp": "ckptconv.commands.dcp", "from_dcp": "ckptconv.commands.dcp"}

__all__ = ["ConversionError", "VerificationError", "__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ckptconv' has no attribute {name!r}")

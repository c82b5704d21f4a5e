"""A DCP ``.metadata`` pickle without importing ``torch.distributed.checkpoint``.

Importing torch's DCP package (for the seven small classes ``.metadata`` pickles) imports
``torch.distributed.tensor`` and sympy with it: ~0.5-0.9 s of CPU, most of what to-dcp's start-up
spent above torch's own import. :func:`metadata_classes` gives stand-ins instead, defined as torch
defines them (fields, defaults, ``__getstate__``), and :func:`dumps` pickles them under torch's
module and class names: the same bytes as ``pickle.dumps`` of torch's objects (a test compares
them). Pickle resolves a class by importing its module, so the stand-ins name a module exactly as
long as torch's (this one, registered under that name too), and the one string naming it in the
pickle is replaced by torch's module name: no other byte moves, and pickling stays C-speed.

The stand-ins are used only while torch's definitions are the ones they copy (the source of each
class, read as text without importing it, has a recorded digest); any other torch gets its own
classes, imported as before.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

# sha256 of the source of the classes copied below (``class_sources``), as torch 2.13.0 defines them
KNOWN_SOURCES = {"a6c05e2d4b14ec95ec648e5ac171c37527259b0d238cee25037efb34f5014e22"}


def alias(module: str) -> str:
    """This module's other name in ``sys.modules``, as long as torch's ``module`` (and neither alias part of the
    other): ``ckptconv.io.dcp_classes.mmmmmmmmmmmmm`` for ``torch.distributed.checkpoint.metadata``."""
    base = __name__ + "."
    assert len(base) < len(module)
    return base + module.rpartition(".")[2][0] * (len(module) - len(base))


# one str object per module, as a module's __name__ is: pickle memoizes it, writing it once
ALIASES = {module: alias(module) for module in (METADATA_MODULE, FILESYSTEM_MODULE)}
for _name in ALIASES.values():
    sys.modules.setdefault(_name, sys.modules[__name__])


def _torch_named(module: str, name: str) -> Any:
    def rename(cls: type) -> type:
        assert cls.__qualname__ == name  # pickle finds it by this name in this module
        cls.__module__ = ALIASES[module]
        return cls
    return rename


@_torch_named(METADATA_MODULE, "_MEM_FORMAT_ENCODING")
class _MEM_FORMAT_ENCODING(Enum):  # noqa: N801  # torch's name
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@_torch_named(METADATA_MODULE, "ChunkStorageMetadata")
@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


@_torch_named(METADATA_MODULE, "TensorProperties")
@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, ...]:
        if self.memory_format != torch.contiguous_format:
            raise AssertionError("DCP items written here are contiguous")
        return (self.dtype, self.layout, self.requires_grad, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
                self.pin_memory)


@_torch_named(METADATA_MODULE, "TensorStorageMetadata")
@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@_torch_named(METADATA_MODULE, "BytesStorageMetadata")
@dataclass
class BytesStorageMetadata:
    pass


@_torch_named(METADATA_MODULE, "StorageMeta")
@dataclass
class StorageMeta:
    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@_torch_named(METADATA_MODULE, "Metadata")
@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@_torch_named(METADATA_MODULE, "MetadataIndex")
@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Any = None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@_torch_named(FILESYSTEM_MODULE, "_StorageInfo")
@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


STAND_INS = (_MEM_FORMAT_ENCODING, ChunkStorageMetadata, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
             StorageMeta, Metadata, MetadataIndex, _StorageInfo)
_COPIED = {METADATA_MODULE: ("_MEM_FORMAT_ENCODING", "ChunkStorageMetadata", "TensorProperties",
                             "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta", "Metadata",
                             "MetadataIndex"),
           FILESYSTEM_MODULE: ("_StorageInfo",)}


def class_sources(module: str, names: tuple[str, ...]) -> str:
    """The source text of each class (its decorators included) of torch's ``module``, read without importing it."""
    try:
        text = (Path(torch.__file__).parent / (module.removeprefix("torch.").replace(".", "/") + ".py")).read_text("utf-8")
    except (OSError, UnicodeError):  # no source beside torch (a zipped or compiled install): torch's own classes
        return f"<{module} unreadable>"
    parts = []
    for name in names:
        m = re.search(rf"^(?:@.*\n)*class {name}\b.*?(?=^[^\s#)]|\Z)", text, re.MULTILINE | re.DOTALL)
        parts.append(m.group(0) if m else f"<{name} missing>")
    return "\n".join(parts)


def sources_digest() -> str:
    return hashlib.sha256("".join(class_sources(m, n) for m, n in _COPIED.items()).encode()).hexdigest()


def metadata_classes() -> SimpleNamespace:
    """The classes ``.metadata`` pickles: the stand-ins where torch's are the ones they copy, else torch's own."""
    if sources_digest() in KNOWN_SOURCES:
        return SimpleNamespace(**{cls.__qualname__.lstrip("_"): cls for cls in STAND_INS if cls is not _MEM_FORMAT_ENCODING})
    from torch.distributed.checkpoint import filesystem, metadata

    return SimpleNamespace(**{name.lstrip("_"): getattr(mod, name) for mod, names in
                              ((metadata, _COPIED[METADATA_MODULE][1:]), (filesystem, _COPIED[FILESYSTEM_MODULE]))
                              for name in names})


def _short_str(text: str) -> bytes:
    """How pickle writes a str under 256 bytes (SHORT_BINUNICODE)."""
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def dumps(meta: Any) -> bytes:
    """``pickle.dumps(meta, protocol=4)``: the stand-ins' module named as torch's."""
    data = pickle.dumps(meta, protocol=4)
    if type(meta) is not Metadata:
        return data
    for module, name in ALIASES.items():
        stand_in, torch_name = _short_str(name), _short_str(module)
        if data.count(name.encode()) != data.count(stand_in) or data.count(stand_in) > 1:
            raise AssertionError(f"{name} appears in a DCP .metadata other than as its one module name")
        data = data.replace(stand_in, torch_name)
    return data

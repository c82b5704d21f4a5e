"""The only place in ckptconv that unpickles data or calls ``torch.load``.

Two ways in:

* :func:`unpickle_restricted` reads a torch ``data.pkl`` with an allowlist of
  globals. Tensor rebuild calls are *not* executed: they become
  :class:`PickledTensor` records that say where the bytes are, so a reader can
  fetch them lazily.
* :func:`load_small` is ``torch.load(weights_only=True)`` for small files
  (xser ``.info.pt``, legacy non-zip files) with ``TensorReference`` allowed.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ckptconv.errors import UnsafeCheckpointError

__all__ = [
    "DcpRecord",
    "PickledTensor",
    "StorageRef",
    "TensorReference",
    "UnsafeCheckpointError",
    "is_torch_zip",
    "load_dcp_metadata",
    "load_small",
    "load_small_bytes",
    "unpickle_restricted",
]

_XLA_MODULE = "torch_xla.utils.serialization"


class _StandInTensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``.

    xser checkpoints store each tensor in a side file and put one of these (with the side
    file's number ``tid``) in the pickle. Pickles exactly like torch_xla's plain class.

    >>> TensorReference(3).tid
    3
    """

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.tid == self.tid  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(("TensorReference", self.tid))

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid!r})"


# Named (and so pickled / recognised) as torch_xla's class.
_StandInTensorReference.__module__ = _XLA_MODULE
_StandInTensorReference.__qualname__ = _StandInTensorReference.__name__ = "TensorReference"


def _resolve_tensor_reference() -> tuple[type, bool]:
    """(class, is_stand_in): the real torch_xla class when installed, else the stand-in."""
    # find_spec avoids importing anything when torch_xla is absent.
    if importlib.util.find_spec("torch_xla") is not None:
        try:
            from torch_xla.utils.serialization import TensorReference as real

            return real, False
        except Exception:  # broken install: fall back to the stand-in
            pass
    return _StandInTensorReference, True


TensorReference, TENSOR_REFERENCE_IS_STAND_IN = _resolve_tensor_reference()


@dataclass(frozen=True)
class StorageRef:
    """A storage named by a persistent id ``('storage', cls, key, location, numel)``."""

    key: str
    dtype: torch.dtype  # element type of the storage (uint8 for UntypedStorage)
    numel: int  # in elements of ``dtype``
    location: str
    untyped: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class PickledTensor:
    """What a ``_rebuild_tensor_v2/v3`` call in a pickle would have built."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class _StorageClass:
    """Placeholder for ``torch.<X>Storage`` in a pickle; never callable."""

    name: str
    dtype: torch.dtype
    untyped: bool


def _storage_classes() -> dict[str, _StorageClass]:
    # Same table torch uses to name typed storages when pickling.
    from torch.storage import _dtype_to_storage_type_map

    out = {n: _StorageClass(n, d, False) for d, n in _dtype_to_storage_type_map().items()}
    out["UntypedStorage"] = _StorageClass("UntypedStorage", torch.uint8, True)
    return out


_STORAGE_CLASSES = _storage_classes()
_DTYPES = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _as_int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise ValueError(f"tensor {what} must be a tuple of ints, got {v!r}")
    return v


def _make_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                 hooks: Any, dtype: torch.dtype, metadata: Any) -> PickledTensor:
    if not isinstance(storage, StorageRef):
        raise ValueError(f"tensor storage must be a persistent storage id, got {type(storage).__name__}")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"tensor storage_offset must be an int >= 0, got {offset!r}")
    if metadata:  # conj/neg bits etc.: not produced by our writers
        raise ValueError(f"tensor metadata is not supported: {metadata!r}")
    shape, strides = _as_int_tuple(tuple(size), "size"), _as_int_tuple(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError(f"tensor size {shape} and stride {strides} differ in length")
    return PickledTensor(storage, offset, shape, strides, dtype, bool(requires_grad))


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, metadata: Any = None) -> PickledTensor:
    """Stand-in for torch._utils._rebuild_tensor_v2: records, never builds."""
    if isinstance(storage, StorageRef) and storage.untyped:
        raise ValueError("_rebuild_tensor_v2 needs a typed storage, got UntypedStorage")
    dtype = storage.dtype if isinstance(storage, StorageRef) else torch.uint8
    return _make_tensor(storage, offset, size, stride, requires_grad, hooks, dtype, metadata)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, metadata: Any = None) -> PickledTensor:
    """Stand-in for torch._utils._rebuild_tensor_v3 (UntypedStorage + dtype)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"_rebuild_tensor_v3 dtype must be a torch.dtype, got {dtype!r}")
    return _make_tensor(storage, offset, size, stride, requires_grad, hooks, dtype, metadata)


def _allowed_global(module: str, name: str) -> object | None:
    """The object a pickle may name as ``module.name``, or None."""
    if module == "torch._utils":
        return {"_rebuild_tensor_v2": _rebuild_v2, "_rebuild_tensor_v3": _rebuild_v3}.get(name)
    if module == "torch":
        if name == "Size":
            return torch.Size
        return _STORAGE_CLASSES.get(name) or _DTYPES.get(name)
    if module == "torch.storage" and name == "UntypedStorage":  # how v3 tensors name it
        return _STORAGE_CLASSES[name]
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    if module == _XLA_MODULE and name == "TensorReference":
        return TensorReference
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose only reachable globals are the allowlist above."""

    def __init__(self, data: bytes, filename: str) -> None:
        super().__init__(io.BytesIO(data))
        self._filename = filename

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_global(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self._filename}: refusing to unpickle global {module}.{name} (not in the allowlist)"
            )
        return obj

    def persistent_load(self, pid: Any) -> StorageRef:
        ok = (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
              and isinstance(pid[1], _StorageClass) and isinstance(pid[2], str)
              and isinstance(pid[3], str) and type(pid[4]) is int and pid[4] >= 0)
        if not ok:
            raise UnsafeCheckpointError(f"{self._filename}: unsupported persistent id {pid!r}")
        cls: _StorageClass = pid[1]
        return StorageRef(pid[2], cls.dtype, pid[4], pid[3], cls.untyped)


def unpickle_restricted(data: bytes, filename: str = "<bytes>") -> Any:
    """Unpickle a torch ``data.pkl`` without executing anything outside the allowlist.

    Tensors come back as :class:`PickledTensor`.

    >>> unpickle_restricted(pickle.dumps({"a": 1}, protocol=2))
    {'a': 1}
    """
    try:
        return _RestrictedUnpickler(data, filename).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # corrupt or hostile data: one error type, naming the file
        raise ValueError(f"{filename}: cannot unpickle: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# torch.distributed.checkpoint's ``.metadata``: a plain pickle of its dataclasses


class DcpRecord:
    """One object of a DCP ``.metadata`` pickle as plain attributes; ``kind`` is its class's name.

    Stands in for torch's own classes, so that reading a ``.metadata`` runs nothing of theirs.
    """

    kind = ""
    _TUPLE_FIELDS: dict[str, tuple[str, ...]] = {
        # TensorProperties pickles as a tuple (its __getstate__)
        "TensorProperties": ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    }

    def __setstate__(self, state: Any) -> None:
        names = self._TUPLE_FIELDS.get(self.kind)
        if isinstance(state, tuple) and names is not None and len(state) == len(names):
            state = dict(zip(names, state, strict=True))
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ValueError(f"{self.kind}: unexpected pickled state {type(state).__name__}")
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:  # only for names the pickle did not set
        raise AttributeError(f"{self.kind} has no field {name!r}")

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__!r})"


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    (module, name): type(name, (DcpRecord,), {"kind": name})
    for module, names in (
        (_DCP_METADATA_MODULE, ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "StorageMeta", "MetadataIndex")),
        ("torch.distributed.checkpoint.filesystem", ("_StorageInfo",)),
    )
    for name in names
}


def _dcp_layout(name: Any) -> str:
    if name != "torch.strided":
        raise ValueError(f"tensor layout {name!r} is not supported (only torch.strided)")
    return "strided"


def _dcp_memory_format(code: Any) -> int:
    if type(code) is not int:
        raise ValueError(f"memory format code must be an int, got {code!r}")
    return code


def _dcp_path(*parts: Any) -> str:
    """``pathlib.PosixPath`` of the checkpoint id it was saved to: kept as text, never used."""
    if not all(isinstance(p, str) for p in parts):
        raise ValueError(f"path parts must be strings, got {parts!r}")
    return "/".join(parts)


def _dcp_global(module: str, name: str) -> object | None:
    if (module, name) in _DCP_CLASSES:
        return _DCP_CLASSES[(module, name)]
    if module == _DCP_METADATA_MODULE and name == "_MEM_FORMAT_ENCODING":
        return _dcp_memory_format
    if module == "torch.serialization" and name == "_get_layout":
        return _dcp_layout
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
        return _dcp_path
    if module == "torch" and (name == "Size" or name in _DTYPES):
        return _allowed_global(module, name)
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    return None


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, filename: str) -> None:
        super().__init__(io.BytesIO(data))
        self._filename = filename

    def find_class(self, module: str, name: str) -> Any:
        obj = _dcp_global(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self._filename}: refusing to unpickle global {module}.{name} (not in the DCP metadata allowlist)"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._filename}: unexpected persistent id {pid!r} in DCP metadata")


def load_dcp_metadata(data: bytes, filename: str = "<bytes>") -> Any:
    """Unpickle a DCP ``.metadata`` file: its objects come back as :class:`DcpRecord`s, dtypes as
    ``torch.dtype``, sizes as ``torch.Size``; nothing else may be named.

    >>> load_dcp_metadata(open("ckpt/.metadata", "rb").read()).kind   # doctest: +SKIP
    'Metadata'
    """
    try:
        return _DcpUnpickler(data, filename).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # corrupt or hostile data: one error type, naming the file
        raise ValueError(f"{filename}: not a DCP metadata file ({type(e).__name__}: {e})") from e


def load_small_bytes(data: bytes, filename: str) -> Any:
    """``torch.load(weights_only=True)`` of an in-memory torch.save blob (a DCP bytes item)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{filename}: refusing to unpickle: {_torch_reason(exc)}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ValueError(f"{filename}: not a readable torch blob ({_torch_reason(exc)})") from None


_safe_globals_added = False


def load_small(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` that also accepts TensorReference.

    For small files only (everything is read into memory).

    >>> load_small("model.pt.info.pt")  # doctest: +SKIP
    """
    global _safe_globals_added
    if not _safe_globals_added:
        torch.serialization.add_safe_globals([(TensorReference, f"{_XLA_MODULE}.TensorReference")])
        _safe_globals_added = True
    try:
        return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _torch_reason(exc)
        if "GLOBAL" in reason or "global" in reason:
            raise UnsafeCheckpointError(f"{os.fspath(path)}: refusing to unpickle: {reason}") from None
        raise ValueError(f"{os.fspath(path)}: not a readable torch file ({reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.filename is not None:
            raise
        raise ValueError(f"{os.fspath(path)}: not a readable torch file ({_torch_reason(exc)})") from None


def _torch_reason(exc: BaseException) -> str:
    """torch.load's own reason, without its advice to rerun with weights_only turned off (which
    would execute whatever the file says) or its documentation pointers."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    kept = [line for line in lines if "weights_only" not in line and "documentation" not in line]
    return " ".join(kept) or type(exc).__name__


def is_torch_zip(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a zip whose first record is ``<archive>/data.pkl`` (torch's zip format).

    >>> is_torch_zip("/etc/hostname")  # doctest: +SKIP
    False
    """
    try:
        with open(path, "rb") as f:
            head = f.read(30)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                return False
            name_len = int.from_bytes(head[26:28], "little")
            name = f.read(name_len)
    except OSError:  # missing, a directory, unreadable
        return False
    return name == b"data.pkl" or name.endswith(b"/data.pkl")

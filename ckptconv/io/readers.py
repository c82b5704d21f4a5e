"""One small interface over the tensor file formats we read: safetensors, torch zip, legacy torch.

Example:
    >>> reader = open_tensor_file("model.safetensors")   # doctest: +SKIP
    >>> reader.info("model.norm.weight")                  # doctest: +SKIP
    (torch.bfloat16, (4096,), False)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles
from ckptconv.io.safe_load import is_torch_zip, load_small
from ckptconv.io.safetensors_io import SafetensorsReader
from ckptconv.io.torchzip import StoredTensor, TorchZipReader
from ckptconv.io.torchzip_read import is_row_major


class FileReader(Protocol):
    def keys(self) -> list[str]: ...

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        """dtype, shape, and True when the tensor is not stored row-major (rows are not contiguous)."""
        ...

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of dim 0, contiguous; into ``out`` (right dtype and size) when given."""
        ...

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor with its stored shape and strides."""
        ...

    def close(self) -> None: ...


def try_read_columns(reader: object, key: Any, start: int, stop: int, out: torch.Tensor) -> bool:
    """Columns ``[start, stop)`` of the matrix ``key`` into ``out``, reading only their bytes, where ``reader`` can
    (its ``read_columns``: safetensors and torch zip files, and the checkpoints over them); False, nothing read, for
    a reader without it or one that declines: the caller reads whole rows and cuts them."""
    read = getattr(reader, "read_columns", None)
    return read is not None and bool(read(key, start, stop, out))


class SafetensorsFileReader:
    def __init__(self, path: Path, io: str) -> None:
        self._reader = SafetensorsReader(path, io=io)

    def keys(self) -> list[str]:
        return self._reader.keys()

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        entry = self._reader.entry(key)
        return entry.dtype, tuple(entry.shape), False

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._reader.read_rows(key, start, stop, out)

    def read_slab_rows(self, key: str, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return self._reader.read_slab_rows(key, slab, start, stop, out)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns [start, stop) of a matrix, only their bytes read (SafetensorsReader.read_columns)."""
        return self._reader.read_columns(key, start, stop, out)

    def read(self, key: str) -> torch.Tensor:
        return self._reader.read(key)

    def close(self) -> None:
        self._reader.close()


class TorchFileReader:
    """A torch.save zip holding a flat dict of tensors."""

    def __init__(self, path: Path, io: str, checks: CheckedFiles | None = None, *, within: str | None = None) -> None:
        self.path = path
        self._reader = TorchZipReader(path, io=io, checks=checks, within=within)
        self.archive = self._reader.archive

    def keys(self) -> list[str]:
        return self._reader.keys()

    def _entry(self, key: str) -> StoredTensor:
        entry = self._reader.entry(key)
        if not isinstance(entry, StoredTensor):
            raise ConversionError(f"{self.path}: {key!r} is a {type(entry).__name__}, expected a tensor")
        return entry

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        entry = self._entry(key)
        return entry.dtype, tuple(entry.shape), not is_row_major(tuple(entry.shape), tuple(entry.stride))

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        self._entry(key)
        return self._reader.read_rows(key, start, stop, out)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns [start, stop) of a matrix, only their bytes read (TorchZipReader.read_columns)."""
        self._entry(key)
        return self._reader.read_columns(key, start, stop, out)

    def read_slab_rows(self, key: str, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of ``key[slab]`` (one matrix of a stacked tensor), reading only their bytes."""
        self._entry(key)
        return self._reader.read_slab_rows(key, slab, start, stop, out)

    def position(self, key: str) -> int:
        """File offset of the tensor's first byte."""
        entry = self._entry(key)
        return entry.data_offset + entry.storage_offset * entry.dtype.itemsize

    def read(self, key: str) -> torch.Tensor:
        self._entry(key)
        return self._reader.read(key)

    def close(self) -> None:
        self._reader.close()


class InMemoryReader:
    """Legacy (pre-zip) torch files cannot be read lazily; they are loaded whole, with a warning."""

    def __init__(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        self.path = path
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        t = self._state[key]
        return t.dtype, tuple(t.shape), not is_row_major(tuple(t.shape), tuple(t.stride()))

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._state[key]
        rows = (t.reshape(1) if t.dim() == 0 else t[start:stop]).contiguous()
        return rows.clone() if out is None else out.view(rows.shape).copy_(rows)

    def read(self, key: str) -> torch.Tensor:
        return self._state[key].clone()

    def close(self) -> None:
        self._state = {}


def open_tensor_file(path: str | Path, *, io: str = "mmap") -> FileReader:
    """Open a tensor file by its content: safetensors, torch zip, or legacy torch pickle."""
    path = Path(path)
    if io not in ("mmap", "read"):
        raise ConversionError(f"--io must be 'mmap' or 'read', got {io!r}")
    with open(path, "rb") as f:
        head = f.read(8)
    if path.suffix == ".safetensors" or (len(head) == 8 and head[:2] != b"PK" and head[0] != 0x80):
        return SafetensorsFileReader(path, io)
    if is_torch_zip(path):
        return TorchFileReader(path, io)
    warnings.warn(f"{path}: legacy (non-zip) torch file; it is loaded whole into memory", stacklevel=2)
    state = load_small(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path}: expected a flat dict of tensors (a state dict)")
    return InMemoryReader(path, state)

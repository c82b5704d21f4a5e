"""Lazy, safe reading of torch zip checkpoints (``torch.save`` files).

Only ``data.pkl`` is parsed up front, through the restricted unpickler in
:mod:`ckptconv.io.safe_load`; tensor bytes are read on demand with mmap or ``os.pread``.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ckptconv.io.checked import CheckedFiles, ZipCrc, crc_error
from ckptconv.io.crc import crc32
from ckptconv.io.positional import FileWindow, PositionalFile
from ckptconv.io.safe_load import PickledTensor, unpickle_restricted
from ckptconv.io.transpose import transpose_into, transposed

__all__ = ["StoredTensor", "TorchZipReader"]

_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are inside a torch zip file.

    ``storage_offset`` is in elements; ``data_offset`` is the absolute file offset of the
    storage record's first byte.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _ZipEntry:
    name: str
    header_offset: int
    size: int
    compressed_size: int
    method: int
    crc: int


def _find_end_record(tail: bytes, path: str) -> int:
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or len(tail) - pos < 22:
        raise ValueError(f"{path}: not a zip file (no end-of-central-directory record)")
    return pos


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when the rows of a tensor with this shape and stride are one contiguous run."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _zip64_values(extra: bytes) -> list[int]:
    """The u64 values of the zip64 extra block (tag 1), in order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            return list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
        pos += 4 + size
    return []


def _central_directory(src: PositionalFile | FileWindow) -> dict[str, _ZipEntry]:
    tail_start = max(0, src.size - 22 - 0xFFFF)
    tail = src.read(tail_start, src.size - tail_start)
    eocd = _find_end_record(tail, src.path)
    n, cd_size, cd_offset = struct.unpack_from("<HII", tail, eocd + 10)
    if eocd >= 20 and tail[eocd - 20:eocd - 16] == b"PK\x06\x07":  # zip64 locator
        (z64_offset,) = struct.unpack_from("<Q", tail, eocd - 12)
        z64 = src.read(z64_offset, 56)
        if z64[:4] != b"PK\x06\x06":
            raise ValueError(f"{src.path}: bad zip64 end record at {z64_offset}")
        n, cd_size, cd_offset = struct.unpack_from("<QQQ", z64, 32)
    cd = src.read(cd_offset, cd_size)
    entries: dict[str, _ZipEntry] = {}
    pos = 0
    for _ in range(n):
        if cd[pos:pos + 4] != b"PK\x01\x02":
            raise ValueError(f"{src.path}: bad central directory entry at {cd_offset + pos}")
        (method, crc, csize, usize, name_len, extra_len, comment_len) = struct.unpack_from("<HxxxxIIIHHH", cd, pos + 10)
        (offset,) = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + name_len].decode("utf-8")
        wide = _zip64_values(cd[pos + 46 + name_len:pos + 46 + name_len + extra_len])
        # zip64 values appear only for fields that overflowed, in this order.
        if usize == _U32:
            usize = wide.pop(0)
        if csize == _U32:
            csize = wide.pop(0)
        if offset == _U32:
            offset = wide.pop(0)
        entries[name] = _ZipEntry(name, offset, usize, csize, method, crc)
        pos += 46 + name_len + extra_len + comment_len
    return entries


class TorchZipReader:
    """Lazy reader of a torch zip file; data.pkl is unpickled safely, tensors read on demand.

    ``io="mmap"`` maps the file; ``io="read"`` uses only ``os.pread`` (for network file systems).
    With ``checks`` (:class:`~ckptconv.io.checked.CheckedFiles`) every record's CRC-32, and the
    file's recorded size and digest, are checked from the bytes read (``checks.finish()`` completes it).

    >>> with TorchZipReader("model.pt", io="read") as r:  # doctest: +SKIP
    ...     w = r.read("w"); top = r.read_rows("w", 0, 2)
    """

    def __init__(self, path: str | os.PathLike[str], io: str = "mmap", checks: CheckedFiles | None = None, *,
                 source: PositionalFile | FileWindow | None = None, within: str | None = None) -> None:
        """``source``: read the zip from this (a window of a larger file: one item of a DCP ``.distcp``)
        instead of opening ``path``; its owner checks the bytes (see :meth:`zip_records`). ``within``:
        the entries are those of the dict stored under this top-level key (nxdtrain's ``master``)."""
        self.path = os.fspath(path)
        self._within = within
        self._src = PositionalFile(self.path, io) if source is None else source
        self._crc_now = checks is not None and checks.enabled  # data.pkl is parsed at once: check it at once
        try:
            if source is None:
                self._src.check = None if checks is None else checks.open(Path(self.path), self._src.copy_into)
            self._zip = _central_directory(self._src)
            if self._src.check is not None and source is None:
                self._src.check.set_zip_records(self.zip_records())
            first = min(self._zip.values(), key=lambda e: e.header_offset, default=None)
            if first is None or not (first.name == "data.pkl" or first.name.endswith("/data.pkl")):
                raise ValueError(f"{self.path}: not a torch zip file (first record is not <archive>/data.pkl)")
            self._prefix = first.name[: -len("data.pkl")]
            self.archive = self._prefix.rstrip("/")
            order = self._zip.get(self._prefix + "byteorder")
            if order is not None and self._record_bytes(order) != b"little":
                raise ValueError(f"{self.path}: big-endian torch files are not supported")
            top = unpickle_restricted(self._record_bytes(first), self.path)
            self._entries = self._resolve(top)
        except BaseException:
            self._src.close()
            raise

    # -- structure -------------------------------------------------------------------------
    def zip_records(self) -> list[ZipCrc]:
        """Every stored record's data extent (offsets in the source) and its recorded CRC-32."""
        return [ZipCrc(e.name, self._data_offset(e), e.compressed_size, e.crc)
                for e in self._zip.values() if e.method == 0]

    def _data_offset(self, entry: _ZipEntry) -> int:
        head = self._src.read(entry.header_offset, 30)
        if head[:4] != b"PK\x03\x04":
            raise ValueError(f"{self.path}: bad local header for {entry.name} at {entry.header_offset}")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        return entry.header_offset + 30 + name_len + extra_len

    def _record_bytes(self, entry: _ZipEntry) -> bytes:
        if entry.method != 0 or entry.compressed_size != entry.size:
            raise ValueError(f"{self.path}: record {entry.name} is compressed (method {entry.method}); "
                             "expected stored records")
        data = self._src.read(self._data_offset(entry), entry.size)
        if self._crc_now and crc32(data) != entry.crc:
            raise crc_error(self.path, entry.name, crc32(data), entry.crc)
        return data

    def _resolve(self, top: Any) -> dict[str, Any]:
        if isinstance(top, PickledTensor):  # torch.save(tensor): one entry under key ""
            top = {"": top}
        if not isinstance(top, dict):
            raise ValueError(f"{self.path}: expected a dict (or a tensor) at top level, got {type(top).__name__}")
        if self._within is not None:
            inner = top.get(self._within)
            if not isinstance(inner, dict):
                raise ValueError(f"{self.path}: no {self._within!r} dict at top level")
            top = inner
        # What a faithful re-save needs besides the items: dict vs OrderedDict, and attributes
        # such as state_dict()'s ``_metadata``.
        self.container_type: type = type(top)
        self.attributes: dict[str, Any] = dict(getattr(top, "__dict__", {}))
        return {k: self._stored(k, v) if isinstance(v, PickledTensor) else v for k, v in top.items()}

    def _stored(self, key: str, pt: PickledTensor) -> StoredTensor:
        name = f"{self._prefix}data/{pt.storage.key}"
        entry = self._zip.get(name)
        if entry is None:
            raise ValueError(f"{self.path}: tensor {key!r}: storage record {name} is missing")
        if entry.method != 0 or entry.size != pt.storage.nbytes:
            raise ValueError(f"{self.path}: tensor {key!r}: record {name} has {entry.size} bytes "
                             f"(method {entry.method}); expected {pt.storage.nbytes} stored bytes")
        if math.prod(pt.shape):
            last = pt.storage_offset + sum((s - 1) * st for s, st in zip(pt.shape, pt.stride, strict=True)) + 1
            if last * pt.dtype.itemsize > entry.size:
                raise ValueError(f"{self.path}: tensor {key!r}: shape {pt.shape} stride {pt.stride} offset "
                                 f"{pt.storage_offset} needs {last * pt.dtype.itemsize} bytes; storage has {entry.size}")
        return StoredTensor(key, pt.dtype, pt.shape, pt.stride, pt.storage_offset, self._data_offset(entry))

    # -- public ----------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Top-level keys in stored order (``[""]`` for a file holding one bare tensor)."""
        return list(self._entries)

    def entry(self, key: str) -> StoredTensor | Any:
        """StoredTensor for a tensor, else the plain value."""
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{self.path}: no key {key!r}") from None

    def adopt(self, key: str, pickled: PickledTensor) -> None:
        """Make a tensor found inside a plain value (a nested dict's) readable as top-level ``key``."""
        if key in self._entries:
            raise ValueError(f"{self.path}: key {key!r} exists already")
        self._entries[key] = self._stored(key, pickled)

    def _tensor(self, key: str) -> StoredTensor:
        e = self.entry(key)
        if not isinstance(e, StoredTensor):
            raise ValueError(f"{self.path}: {key!r} is a {type(e).__name__}, not a tensor")
        return e

    def locate(self, where: str, pt: PickledTensor) -> StoredTensor:
        """A tensor nested below the top level (an optimizer's ``state[i]["exp_avg"]``), checked
        against its storage record like a top-level one; ``where`` names it in errors."""
        return self._stored(where, pt)

    def _read_elements(self, st: StoredTensor, first: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [first, first+count) of the storage, as a new 1-D tensor (or into ``out``)."""
        out = torch.empty(count, dtype=st.dtype) if out is None else out.view(-1)
        if count:
            dst = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]
            self._src.read_into(st.data_offset + first * st.dtype.itemsize, dst)
        return out

    def read(self, key: str) -> torch.Tensor:
        """The tensor as a new tensor owning its memory, with the stored stride.

        >>> r.read("w").stride()  # doctest: +SKIP
        (1, 4)
        """
        return self.read_stored(self._tensor(key))

    def read_stored(self, st: StoredTensor) -> torch.Tensor:
        """:meth:`read` of a tensor found by :meth:`locate` (or :meth:`entry`)."""
        if st.numel == 0:
            return torch.empty_strided(st.shape, st.stride, dtype=st.dtype)
        span = sum((s - 1) * t for s, t in zip(st.shape, st.stride, strict=True)) + 1
        return self._read_elements(st, st.storage_offset, span).as_strided(st.shape, st.stride, 0)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of dim 0 as a contiguous tensor (a 0-dim tensor is one row: shape (n,)).

        Row-major tensors read exactly those bytes (straight into ``out`` when given: a contiguous
        tensor of the right dtype and size); column-major ones read one run per column.

        >>> r.read_rows("w", 2, 4).shape  # doctest: +SKIP
        torch.Size([2, 8])
        """
        return self.read_stored_rows(self._tensor(key), start, stop, out)

    def read_slab_rows(self, key: str, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of ``key[slab]`` (one matrix of a stacked tensor), reading only their bytes."""
        st = self._tensor(key)
        if len(st.shape) < 2 or not 0 <= slab < st.shape[0]:
            raise ValueError(f"{self.path}: {key!r} of shape {list(st.shape)} has no slab {slab}")
        within = replace(st, shape=st.shape[1:], stride=st.stride[1:],
                         storage_offset=st.storage_offset + slab * st.stride[0])
        return self.read_stored_rows(within, start, stop, out)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns ``[start, stop)`` of the matrix ``key`` into ``out`` (contiguous, of its dtype, ``(rows, stop -
        start)``), reading only their bytes: one run of a column-major matrix (its columns lie together: NxD's
        ``o_proj`` with QKV linear), a part of every row of a row-major one. False (nothing read) for other strides
        and for a row-major matrix under checks (they see whole rows): the caller reads rows then."""
        st = self._tensor(key)
        if len(st.shape) != 2 or not 0 <= start <= stop <= st.shape[1]:
            raise ValueError(f"{self.path}: tensor {key!r} of shape {list(st.shape)}: no columns [{start}, {stop})")
        rows, width = st.shape[0], stop - start
        if out.dtype != st.dtype or not out.is_contiguous() or tuple(out.shape) != (rows, width):
            raise ValueError(f"{self.path}: {key!r}: out must be a contiguous {st.dtype} of shape {[rows, width]}, "
                             f"got {out.dtype} of {list(out.shape)}")
        if st.stride == (1, rows):
            transpose_into(out, self._read_elements(st, st.storage_offset + start * rows, width * rows).view(width, rows))
            return True
        copy_columns = getattr(self._src, "copy_columns_into", None)
        if st.stride != (st.shape[1], 1) or copy_columns is None:
            return False
        size = st.dtype.itemsize
        return bool(copy_columns(st.data_offset + st.storage_offset * size, st.shape[1] * size, start * size,
                                 out.view(torch.uint8).view(rows, width * size)))

    def read_stored_rows(self, st: StoredTensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`read_rows` of a tensor found by :meth:`locate` (or :meth:`entry`)."""
        key = st.key
        shape, stride = (st.shape, st.stride) if st.shape else ((1,), (1,))
        if not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{self.path}: {key!r}: rows [{start}, {stop}) out of range; expected within [0, {shape[0]}]")
        n, rest, rest_stride = stop - start, shape[1:], stride[1:]
        if n == 0 or math.prod(rest) == 0:
            return torch.empty((n, *rest), dtype=st.dtype)
        first = st.storage_offset + start * stride[0]
        span = (n - 1) * stride[0] + sum((s - 1) * t for s, t in zip(rest, rest_stride, strict=True)) + 1
        if out is not None and (out.dtype != st.dtype or not out.is_contiguous() or out.numel() != n * math.prod(rest)):
            raise ValueError(f"{self.path}: {key!r}: out must be a contiguous {st.dtype} of {n * math.prod(rest)} "
                             f"elements, got {out.dtype} of {out.numel()}")
        if out is not None and is_row_major(shape, stride):  # the rows are one run of bytes
            return self._read_elements(st, first, span, out).view(n, *rest)
        if stride[0] == 1 and rest and span > 2 * n * math.prod(rest):
            result = self._gather_runs(st, first, n, rest, rest_stride)
        else:
            result = self._read_elements(st, first, span).as_strided((n, *rest), stride, 0).contiguous()
        return result if out is None else out.view(n, *rest).copy_(result)

    def _gather_runs(self, st: StoredTensor, first: int, n: int, rest: tuple[int, ...],
                     rest_stride: tuple[int, ...]) -> torch.Tensor:
        """Dim 0 has stride 1 (column-major): read one run of n elements per index of the other dims."""
        offsets = torch.zeros((), dtype=torch.int64)
        for size, step in zip(rest, rest_stride, strict=True):
            offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * step
        runs = torch.empty((offsets.numel(), n), dtype=st.dtype)
        raw = memoryview(runs.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        run_bytes, itemsize = n * st.dtype.itemsize, st.dtype.itemsize
        for j, off in enumerate(offsets.reshape(-1).tolist()):
            self._src.read_into(st.data_offset + (first + off) * itemsize, raw[j * run_bytes:(j + 1) * run_bytes])
        return transposed(runs).reshape(n, *rest)

    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> TorchZipReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

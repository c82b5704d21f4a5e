"""Lazy safetensors reading and streaming safetensors writing, never holding a whole file.

Format (little-endian): u64 header length ``N``; ``N`` bytes of UTF-8 JSON mapping names to
``{"dtype", "shape", "data_offsets"}`` (relative to the data start) plus optional
``"__metadata__"`` (str -> str); then raw tensor bytes, accessed here by explicit byte ranges.
"""

from __future__ import annotations

import ctypes
import json
import math
import operator
import os
import struct
import sys
import threading
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from ckptconv.io.direct_io import close_output, open_output
from ckptconv.io.positional import PositionalFile
from ckptconv.io.write_digest import WriteDigest, open_digest, write_to

PathLike = str | os.PathLike[str]
BytesLike = bytes | bytearray | memoryview | torch.Tensor

# Tensor order used by safetensors' own serializer (descending Rust `Dtype` enum order,
# found by saving one tensor of every dtype with safetensors 0.8.0). Byte identity with
# `safetensors.torch.save_file` depends on this order, so it is pinned here.
# fmt: off
_FILE_ORDER: tuple[tuple[str, str], ...] = (
    ("U64", "uint64"), ("I64", "int64"), ("F64", "float64"), ("C64", "complex64"), ("F32", "float32"),
    ("U32", "uint32"), ("I32", "int32"), ("BF16", "bfloat16"), ("F16", "float16"), ("U16", "uint16"),
    ("I16", "int16"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
)
# fmt: on
# Older torch builds lack some dtypes; only those this torch has are supported.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in _FILE_ORDER if hasattr(torch, attr)}
DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}
_RANK: dict[str, int] = {name: i for i, (name, _) in enumerate(_FILE_ORDER)}

_MAX_HEADER = 100_000_000  # same cap as the reference implementation; bounds memory on bad input
_METADATA_KEY = "__metadata__"
if sys.byteorder != "little":  # the format is little-endian and bytes are copied without swapping
    raise ImportError("ckptconv.io.safetensors_io supports little-endian hosts only")


class SafetensorsFormatError(ValueError):
    """A safetensors file is malformed; the message names the file (and key, if any)."""


class NotSafetensorsError(SafetensorsFormatError):
    """The file's first 8 bytes cannot be a safetensors header length (a JSON or text file, say)."""


class TruncatedSafetensorsError(SafetensorsFormatError):
    """A well-formed header whose tensors need more bytes than the file holds: the file was cut short."""


class SafetensorsWriteError(ValueError):
    """A write does not fit the layout (bad range, overlap, missing bytes)."""


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor's place in a file; ``data_offset`` is an absolute file offset."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsLayout:
    """Result of :func:`plan_safetensors`: exact header bytes and where each tensor goes."""

    header: bytes  # 8-byte length prefix + padded JSON; data starts at len(header)
    entries: dict[str, SafetensorsEntry]  # in file order
    total_size: int
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return len(self.header)


def _dumps(obj: Any) -> str:
    # Matches serde_json's compact output: no spaces, non-ASCII kept, same escapes.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _as_bytes(data: BytesLike, where: str) -> memoryview:
    if isinstance(data, torch.Tensor):
        # conj/neg bits are lazy flags: the raw memory would not hold the values the tensor shows
        if data.device.type != "cpu" or not data.is_contiguous() or data.is_conj() or data.is_neg():
            raise SafetensorsWriteError(f"{where}: write_extent needs a contiguous CPU tensor without conj/neg bits")
        return _tensor_bytes(data)
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def plan_safetensors(
    entries: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> SafetensorsLayout:
    """Compute header bytes and offsets exactly as ``safetensors.torch.save_file`` would.

    Tensors are ordered by dtype (widest first, safetensors' enum order) then by name;
    the JSON is compact and space-padded to a multiple of 8 bytes. Metadata keys are
    written in the given order (safetensors itself uses hash order, so for more than
    one metadata key its output differs between runs).

    Example:
        >>> lay = plan_safetensors({"w": (torch.float32, (2, 3)), "b": (torch.int8, (3,))})
        >>> [(e.key, e.data_offset - lay.data_start) for e in lay.entries.values()]
        [('w', 0), ('b', 24)]
    """
    planned = []
    for key, (dtype, shape) in entries.items():
        if not isinstance(key, str) or key == _METADATA_KEY:
            raise ValueError(f"invalid tensor name {key!r}")
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {key!r}: unsupported dtype {dtype}")
        dims = tuple(operator.index(d) for d in shape)  # rejects floats
        if any(d < 0 for d in dims) or any(isinstance(d, bool) for d in shape):
            raise ValueError(f"tensor {key!r}: invalid shape {tuple(shape)}")
        planned.append((key, dtype, dims))
    # Python str order equals UTF-8 byte order, which is what the Rust sort compares.
    planned.sort(key=lambda p: (_RANK[DTYPE_NAMES[p[1]]], p[0]))
    meta = None if metadata is None else dict(metadata)
    if meta is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata must map str to str")
    parts = [] if meta is None else [f"{_dumps(_METADATA_KEY)}:{_dumps(meta)}"]
    offsets = [0]  # relative to the data region
    for key, dtype, dims in planned:
        offsets.append(offsets[-1] + math.prod(dims) * dtype.itemsize)
        parts.append(
            f'{_dumps(key)}:{{"dtype":"{DTYPE_NAMES[dtype]}","shape":[{",".join(map(str, dims))}],'
            f'"data_offsets":[{offsets[-2]},{offsets[-1]}]}}'
        )
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % 8)  # the reference pads with spaces to 8-byte alignment
    header = struct.pack("<Q", len(body)) + body
    laid = {
        key: SafetensorsEntry(key, dtype, dims, len(header) + begin, end - begin)
        for (key, dtype, dims), begin, end in zip(planned, offsets, offsets[1:], strict=False)
    }
    return SafetensorsLayout(header, laid, len(header) + offsets[-1], meta)


def _fail(path: str, msg: str, key: str | None = None) -> SafetensorsFormatError:
    where = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    return SafetensorsFormatError((where + msg).replace("\n", " "))


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # json would silently keep the last of duplicate keys
    if len(out) != len(pairs):
        dup = next(k for k, count in Counter(k for k, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _parse_entry(path: str, key: str, raw: Any, data_len: int, start: int) -> SafetensorsEntry:
    """Validate one header entry against the data region ``[0, data_len)``."""
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= raw.keys():
        raise _fail(path, f"expected an object with dtype, shape, data_offsets, got {raw!r:.80}", key)
    name, shape, offs = raw["dtype"], raw["shape"], raw["data_offsets"]
    if name not in DTYPES:
        raise _fail(path, f"unknown dtype {name!r}, expected one of {sorted(DTYPES)}", key)
    # `type(x) is int` because JSON true/false parse as bools, a subclass of int.
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        raise _fail(path, f"shape must be a list of non-negative ints, got {shape!r}", key)
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
        raise _fail(path, f"data_offsets must be [begin, end] ints, got {offs!r}", key)
    begin, end = offs
    if not 0 <= begin <= end <= data_len:
        raise _fail(path, f"data_offsets {offs} outside data region [0, {data_len}]", key)
    dtype = DTYPES[name]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _fail(path, f"expected {expected} bytes for {name}{shape}, data_offsets {offs} span {end - begin}", key)
    return SafetensorsEntry(key, dtype, tuple(shape), start + begin, expected)


def _check_complete(path: str, header: dict[str, Any], start: int, size: int) -> None:
    """A header whose tensors tile their data region from 0 (as every writer lays them out) in a file that ends
    before that region does: the file is truncated, named with the size it should have. Other bad offsets are
    left to :func:`_parse_entry`, which names the tensor."""
    offsets = [v.get("data_offsets") if isinstance(v, dict) else None for v in header.values()]
    if not offsets or not all(isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o) for o in offsets):
        return
    spans = sorted(tuple(o) for o in offsets if o is not None)
    ends = [0, *(end for _, end in spans)]
    if any(begin != before for (begin, _), before in zip(spans, ends, strict=False)) or start + ends[-1] <= size:
        return
    raise TruncatedSafetensorsError(f"{path}: truncated (an incomplete download?): the file is {size} bytes, its "
                                    f"header needs {start + ends[-1]}; download or copy it again")


def _check_overlaps(path: str, entries: list[SafetensorsEntry], start: int) -> None:
    spans = sorted((e.data_offset, e.data_offset + e.nbytes, e.key) for e in entries if e.nbytes)
    for (b0, e0, k0), (b1, e1, k1) in pairwise(spans):
        if b1 < e0:
            raise _fail(path, f"data [{b1 - start}, {e1 - start}) overlaps {k0!r} at [{b0 - start}, {e0 - start})", k1)


class SafetensorsReader:
    """Lazy, validating reader; only the bytes of requested tensors/rows are touched.

    ``io="mmap"`` maps the file (fast on local disks); ``io="read"`` uses ``os.preadv``
    into freshly allocated tensors (avoids slow page faults on network file systems).

    Example:
        >>> with SafetensorsReader("model.safetensors", io="read") as r:  # doctest: +SKIP
        ...     emb = r.read_rows("embed.weight", 0, 1024)
    """

    def __init__(self, path: PathLike, io: str = "mmap") -> None:
        if io not in ("mmap", "read"):
            raise ValueError(f"io must be 'mmap' or 'read', got {io!r}")
        self.path = os.fspath(path)
        self.io = io
        self._file = PositionalFile(self.path, io)
        self._size = self._file.size
        try:
            self.metadata, self._entries = self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def _parse_header(self) -> tuple[dict[str, str] | None, dict[str, SafetensorsEntry]]:
        path, size = self.path, self._size
        if size < 8:
            raise _fail(path, f"file is {size} bytes, expected at least 8 for the header length")
        (n,) = struct.unpack("<Q", self._pread(0, 8))
        if n > size - 8 or n > _MAX_HEADER:
            raise NotSafetensorsError(f"{path}: not a safetensors file (header length {n} exceeds "
                                      f"{min(size - 8, _MAX_HEADER)} available bytes)")
        try:
            header = json.loads(self._pread(8, n).decode("utf-8"), object_pairs_hook=_unique_object)
        except (ValueError, RecursionError) as e:
            raise _fail(path, f"header is not valid UTF-8 JSON: {e}") from None
        if not isinstance(header, dict):
            raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
        metadata = header.pop(_METADATA_KEY, None)
        if not (metadata is None or isinstance(metadata, dict) and all(type(v) is str for v in metadata.values())):
            raise _fail(path, f"__metadata__ must map str to str, got {metadata!r:.80}")
        start = 8 + n
        _check_complete(path, header, start, size)
        entries = [_parse_entry(path, k, v, size - start, start) for k, v in header.items()]
        _check_overlaps(path, entries, start)
        entries.sort(key=lambda e: e.data_offset)  # stable: ties keep header order
        return metadata, {e.key: e for e in entries}

    def _pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._file.fd, n, offset)
        if len(data) != n:
            raise _fail(self.path, f"short read: wanted {n} bytes at {offset}, got {len(data)}")
        return data

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Tensor names in file order (ascending data offset), e.g. ``['embed.weight', 'norm.weight']``."""
        return list(self._entries)

    def entry(self, key: str) -> SafetensorsEntry:
        """Dtype, shape and byte location of ``key``, e.g. ``r.entry("w").shape == (4096, 4096)``."""
        if key not in self._entries:
            raise KeyError(f"{self.path}: no tensor {key!r}")
        return self._entries[key]

    def read(self, key: str) -> torch.Tensor:
        """Whole tensor as a new CPU tensor owning its memory, e.g. ``w = r.read("lm_head.weight")``."""
        e = self.entry(key)
        return self._load(e.data_offset, e.nbytes, e.dtype, e.shape)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0, reading only their bytes (into ``out`` when given:
        a contiguous tensor of the right dtype and size, e.g. a reused buffer).

        Example: ``r.read_rows("embed.weight", 10, 12).shape == (2, 4096)``.
        """
        e = self.entry(key)
        if not e.shape:
            raise ValueError(f"{self.path}: tensor {key!r}: read_rows needs >= 1 dim, shape is ()")
        if not 0 <= start <= stop <= e.shape[0]:
            raise ValueError(f"{self.path}: tensor {key!r}: rows [{start}, {stop}) outside [0, {e.shape[0]}]")
        row = e.nbytes // e.shape[0] if e.shape[0] else 0
        return self._rows_at(e, e.data_offset + start * row, (stop - start) * row, (stop - start,) + e.shape[1:], out)

    def read_slab_rows(self, key: str, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key[slab]`` (a stacked tensor's one matrix), reading only their bytes: one
        fused expert's gate rows without its up rows, say.

        Example: ``r.read_slab_rows("experts.gate_up_proj", 3, 0, 16).shape == (16, 4096)``.
        """
        e = self.entry(key)
        if len(e.shape) < 2 or not 0 <= slab < e.shape[0] or not 0 <= start <= stop <= e.shape[1]:
            raise ValueError(f"{self.path}: tensor {key!r} of shape {list(e.shape)}: no rows [{start}, {stop}) "
                             f"of slab {slab}")
        row = e.nbytes // max(1, e.shape[0] * e.shape[1])
        offset = e.data_offset + (slab * e.shape[1] + start) * row
        return self._rows_at(e, offset, (stop - start) * row, (stop - start,) + e.shape[2:], out)

    def _rows_at(self, e: SafetensorsEntry, offset: int, nbytes: int, shape: tuple[int, ...],
                 out: torch.Tensor | None) -> torch.Tensor:
        """``nbytes`` of ``e`` from file ``offset`` as a tensor of ``shape`` (into ``out`` when given)."""
        if out is not None:
            _check_out(self.path, e.key, out, e.dtype, nbytes)
            if out.numel():
                self._read_into(offset, _tensor_bytes(out.view(torch.uint8)))
            return out.view(shape)
        return self._load(offset, nbytes, e.dtype, shape)

    def read_columns(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns ``[start, stop)`` of every row of the matrix ``key`` into ``out`` (contiguous, of its dtype,
        ``(rows, stop - start)``), reading only their bytes; False (nothing read) where only whole rows can be read
        (checked reads): the caller reads rows then."""
        e = self.entry(key)
        if len(e.shape) != 2 or not 0 <= start <= stop <= e.shape[1]:
            raise ValueError(f"{self.path}: tensor {key!r} of shape {e.shape}: no columns [{start}, {stop})")
        _check_out(self.path, key, out, e.dtype, e.shape[0] * (stop - start) * e.dtype.itemsize)
        size = e.dtype.itemsize
        try:
            return self._file.copy_columns_into(e.data_offset, e.shape[1] * size, start * size,
                                                out.view(torch.uint8).view(e.shape[0], (stop - start) * size))
        except ValueError as exc:
            raise _fail(self.path, str(exc).removeprefix(f"{self.path}: ")) from None

    def _load(self, offset: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            self._read_into(offset, _tensor_bytes(buf))
        return buf.view(dtype).reshape(shape)

    def _read_into(self, offset: int, dst: memoryview) -> None:
        try:
            self._file.read_into(offset, dst)
        except ValueError as exc:
            raise _fail(self.path, str(exc).removeprefix(f"{self.path}: ")) from None

    def close(self) -> None:
        """Release the mapping and file descriptor (idempotent)."""
        self._file.close()


class _Coverage:
    """Sorted, merged, disjoint ``[start, end)`` intervals of bytes already written."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, start)
        if i and self.ends[i - 1] > start:
            return self.starts[i - 1], self.ends[i - 1]
        if i < len(self.starts) and self.starts[i] < end:
            return self.starts[i], self.ends[i]
        return None

    def add(self, start: int, end: int) -> None:
        """Insert a non-overlapping interval, merging touching neighbours."""
        i = bisect_right(self.starts, start)
        if i < len(self.starts) and self.starts[i] == end:
            end = self.ends.pop(i)
            self.starts.pop(i)
        if i and self.ends[i - 1] == start:
            self.ends[i - 1] = end
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)

    def first_gap(self, total: int) -> tuple[int, int] | None:
        pos = 0
        for s, e in zip(self.starts, self.ends, strict=True):
            if s > pos:
                return pos, s
            pos = e
        return (pos, total) if pos < total else None




def _check_out(path: str, key: str, out: torch.Tensor, dtype: torch.dtype, nbytes: int) -> None:
    if out.dtype != dtype or not out.is_contiguous() or out.numel() * out.element_size() != nbytes:
        raise ValueError(f"{path}: tensor {key!r}: out must be a contiguous {dtype} of {nbytes} bytes, "
                         f"got {out.dtype} of {out.numel() * out.element_size()} bytes")


class SafetensorsExtentWriter:
    """Writes tensor byte ranges into an already laid-out file (no header writes).

    Several processes may each hold one on the same path and write disjoint extents;
    :meth:`written` reports what this one wrote so a coordinator can verify coverage. Close
    it before the coordinator's ``finish()``: on NFS, close is what flushes the data.

    Example: ``results = pool.map(worker, parts)`` where each worker does
    ``with open_for_extents(path, layout) as w: w.write_extent(...); return w.written()``.
    """

    def __init__(self, path: PathLike, layout: SafetensorsLayout, fd: int) -> None:
        self.path, self.layout, self._fd = os.fspath(path), layout, fd
        self._coverage = {key: _Coverage() for key in layout.entries}
        self._lock = threading.Lock()  # pwrite is thread-safe; the bookkeeping is not
        self._failed: str | None = None
        self._digest: WriteDigest | None = None  # the file's digest as written (SafetensorsWriter's own file)

    def __enter__(self) -> SafetensorsExtentWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()

    def _entry(self, key: str) -> SafetensorsEntry:
        if key not in self.layout.entries:
            raise SafetensorsWriteError(f"{self.path}: tensor {key!r} is not in the layout")
        return self.layout.entries[key]

    def _claim(self, key: str, start: int, end: int) -> None:
        e = self._entry(key)
        if not 0 <= start <= end <= e.nbytes:
            raise SafetensorsWriteError(f"{self.path}: tensor {key!r}: extent [{start}, {end}) outside [0, {e.nbytes})")
        with self._lock:
            hit = self._coverage[key].overlap(start, end)
            if hit is not None:
                where = f"{self.path}: tensor {key!r}: extent [{start}, {end})"
                raise SafetensorsWriteError(f"{where} overlaps already written [{hit[0]}, {hit[1]})")
            self._coverage[key].add(start, end)

    def write_extent(self, key: str, offset_in_tensor: int, data: BytesLike) -> None:
        """Write raw bytes at byte ``offset_in_tensor`` of tensor ``key``; each byte exactly once.

        Example: ``w.write_extent("w", 2 * row_nbytes, rows_2_to_5.view(torch.uint8))``.
        """
        if self._fd < 0:
            raise SafetensorsWriteError(f"{self.path}: writer is closed")
        mv = _as_bytes(data, f"{self.path}: tensor {key!r}")
        if not len(mv):
            return
        self._claim(key, offset_in_tensor, offset_in_tensor + len(mv))
        try:
            write_to(self._fd, mv, self.file_offset(key, offset_in_tensor), self._digest)
        except BaseException as exc:  # bytes are claimed but maybe not on disk: poison
            self._failed = f"write of {key!r} failed: {exc}"
            raise

    def file_offset(self, key: str, offset_in_tensor: int) -> int:
        """Where byte ``offset_in_tensor`` of tensor ``key`` lies in the file."""
        return self._entry(key).data_offset + offset_in_tensor

    def claim(self, key: str, offset_in_tensor: int, length: int) -> Callable[[], None]:
        """Announce that these bytes of ``key`` are being computed (ckptconv.io.write_digest.WriteDigest.claim);
        returns the release."""
        if self._digest is None:
            return lambda: None
        return self._digest.claim(self.file_offset(key, offset_in_tensor), length)

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        """Write a whole tensor whose dtype and shape match the layout, e.g. ``w.write_tensor("b", bias)``."""
        e = self._entry(key)
        if tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
            got = f"{tensor.dtype}{list(tensor.shape)}"
            raise SafetensorsWriteError(f"{self.path}: tensor {key!r}: expected {e.dtype}{list(e.shape)}, got {got}")
        self.write_extent(key, 0, tensor.detach().cpu().resolve_conj().resolve_neg().contiguous())

    def written(self) -> dict[str, list[tuple[int, int]]]:
        """Merged byte ranges written per tensor (only tensors with any bytes)."""
        with self._lock:
            return {k: list(zip(c.starts, c.ends, strict=True)) for k, c in self._coverage.items() if c.starts}

    def close(self) -> None:
        """Close the descriptor without any checks (idempotent)."""
        if self._fd >= 0:
            close_output(self._fd)
            self._fd = -1


class SafetensorsWriter(SafetensorsExtentWriter):
    """Creates ``path`` with the layout's header at its final size, then takes extents.

    Example:
        >>> lay = plan_safetensors({"w": (torch.float32, (2,))})
        >>> with SafetensorsWriter("out.safetensors", lay) as w:  # doctest: +SKIP
        ...     w.write_tensor("w", torch.ones(2))  # finish() runs on a clean exit
    """

    def __init__(self, path: PathLike, layout: SafetensorsLayout, *, reserve: bool = False) -> None:
        # read-write: a digest computed as the file is written reads back ranges written out of order
        fd = open_output(path)
        try:
            super().__init__(path, layout, fd)
        except BaseException:
            close_output(fd)
            raise
        try:
            self._digest = open_digest(path, fd)
            write_to(fd, memoryview(layout.header), 0, self._digest)
            # ftruncate is instant everywhere (sparse); posix_fallocate reserves real blocks
            # but glibc emulates it byte-by-block on file systems without fallocate.
            os.ftruncate(fd, layout.total_size)
            if reserve and layout.total_size:
                os.posix_fallocate(fd, 0, layout.total_size)
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self._fd >= 0:
            self.finish()
        self.close()

    def add_written(self, written: Mapping[str, list[tuple[int, int]]]) -> None:
        """Record extents other processes wrote, e.g. ``w.add_written(child_writer.written())``."""
        for key, spans in written.items():
            for start, end in spans:
                self._claim(key, start, end)

    def finish(self, fsync: bool = False) -> None:
        """Check every tensor byte was written exactly once, optionally fsync, then close.

        Example: ``w.finish(fsync=True)`` raises ``SafetensorsWriteError`` naming the key and gap.
        """
        if self._fd < 0:
            raise SafetensorsWriteError(f"{self.path}: writer is already closed")
        try:
            if self._failed is not None:
                raise SafetensorsWriteError(f"{self.path}: {self._failed}")
            for key, e in self.layout.entries.items():
                if (gap := self._coverage[key].first_gap(e.nbytes)) is not None:
                    msg = f"tensor {key!r}: bytes [{gap[0]}, {gap[1]}) of {e.nbytes} never written"
                    raise SafetensorsWriteError(f"{self.path}: {msg}")
            if self._digest is not None:
                self._digest.finish()
            if fsync:
                os.fsync(self._fd)
        finally:
            self.close()


def open_for_extents(path: PathLike, layout: SafetensorsLayout) -> SafetensorsExtentWriter:
    """Open a file already created by :class:`SafetensorsWriter` for extent writes only.

    Example: ``with open_for_extents(path, plan_safetensors(specs)) as w: w.write_extent("w", 0, buf)``.
    """
    fd = os.open(os.fspath(path), os.O_WRONLY)
    size = os.fstat(fd).st_size
    if size != layout.total_size:
        os.close(fd)
        raise SafetensorsWriteError(f"{os.fspath(path)}: size {size} != layout size {layout.total_size}")
    return SafetensorsExtentWriter(path, layout, fd)

"""Write (and re-export the reader for) torch zip checkpoints, byte-identical to ``torch.save``.

The file layout is a pure function of the archive name and tensor metadata (:func:`plan_zip`), so
tensor bytes can be written later, in pieces, in any order, by several processes
(:class:`TorchZipWriter`); the pieces' CRCs are combined at the end.

What torch.save (miniz, via caffe2's PyTorchStreamWriter) writes, record by record, in this order:
``data.pkl``, ``.format_version`` ("1"), ``.storage_alignment`` ("64"), ``byteorder`` ("little"),
``data/0`` .. ``data/N-1``, ``version`` ("3\\n"), ``.data/serialization_id``, each named
``<archive>/<record>``:

* local header: version needed 0, flags 0x0808 (data descriptor, UTF-8), stored, time/date 0,
  CRC and sizes 0. Extra field: a zip64 block (tag 1) when size >= 0xFFFFFFFF (uncompressed size,
  then a *zero* compressed size) and/or header offset >= 0xFFFFFFFF (the offset), then
  ``FB`` + le16 padding length + that many ``Z``, so the data starts at a multiple of 64;
* data descriptor: ``PK\\7\\8``, CRC, sizes as u32 (16 bytes), or u64 (24 bytes) for zip64 records;
  an empty record (0-byte storage) has flags 0x0800 and no descriptor at all;
* central directory entry: made-by/needed 0, flags 0x0808, time/date/attributes 0; 32-bit fields
  that overflow read 0xFFFFFFFF and the values go to a zip64 extra (size, size, offset); no FB field;
* zip64 end record (made-by 0x031e, needed 45), zip64 locator and end record (counts capped at
  0xFFFF, size/offset at 0xFFFFFFFF), always, even for tiny files.
"""

from __future__ import annotations

import functools
import io
import os
import re
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptconv.io.crc import RunningCrc, crc32
from ckptconv.io.direct_io import close_output, open_output
from ckptconv.io.torchzip_pickle import SUPPORTED_DTYPES, TensorAt, TensorMeta, pickle_entries
from ckptconv.io.torchzip_read import StoredTensor, TorchZipReader
from ckptconv.io.write_digest import WriteDigest, open_digest, write_to

__all__ = [
    "SUPPORTED_DTYPES", "StoredTensor", "TensorAt", "TensorMeta", "TorchZipReader", "TorchZipWriter", "ZipLayout",
    "ZipRecord", "archive_name_for", "crc32_combine", "plan_zip", "pwrite_extent", "save_state_dict",
]

_ALIGN = 64  # torch's default storage alignment (torch.utils.serialization.config)
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_END_RECORDS_SIZE = 56 + 20 + 22  # zip64 end record + zip64 locator + end record
_SMALL_RECORDS = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_VERSION = b"3\n"

# ----------------------------------------------------------------------------- CRC-32 combination
_POLY = 0xEDB88320  # CRC-32 polynomial, bit-reversed: bit 31 is x^0


def _mulmod(a: int, b: int) -> int:
    """a*b mod P over GF(2), both in CRC-32's reflected representation."""
    product, mask = 0, 1 << 31
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b *= x
    return product


@functools.cache
def _x_pow2k(k: int) -> int:
    """x^(2^k) mod P, by repeated squaring from x (= 1 << 30)."""
    return 1 << 30 if k == 0 else _mulmod(_x_pow2k(k - 1), _x_pow2k(k - 1))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B).

    Appending len2 bytes multiplies A's remainder by x^(8*len2); the init/final XORs cancel.

    >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
    True
    """
    if len2 < 0:
        raise ValueError(f"crc32_combine: len2 must be >= 0, got {len2}")
    shift, k, n = 1 << 31, 3, len2  # x^0; 8*len2 = len2 * 2^3
    while n:
        if n & 1:
            shift = _mulmod(_x_pow2k(k), shift)
        n >>= 1
        k += 1
    return _mulmod(shift, crc1) ^ crc2


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine in uint64 arithmetic (serialization_id's CRC part)."""
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & _U64


@functools.cache
def _record_name_hash(n_storages: int) -> int:
    """First half of serialization_id: torch hashes its set of record names, which depends only
    on the number of storages, so ask torch itself with N tiny tensors."""
    buf = io.BytesIO()
    torch.save({str(i): torch.zeros(1, dtype=torch.uint8) for i in range(n_storages)}, buf)
    with zipfile.ZipFile(buf) as z:
        sid = z.read("archive/.data/serialization_id").decode()
    return int(sid[:20])


# ----------------------------------------------------------------------------- layout
def archive_name_for(path: str | os.PathLike[str]) -> str:
    """The record prefix torch.save uses for ``path``: basename up to its last dot.

    >>> archive_name_for("/ckpt/dp_rank_00_tp_rank_01_pp_rank_00.pt")
    'dp_rank_00_tp_rank_01_pp_rank_00'
    """
    name = os.fspath(path)
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if not name.isascii():
        return "archive"  # torch writes non-ASCII paths through a Python stream: generic name
    base = re.split(r"[/\\]", name)[-1]
    stem = base[: base.rfind(".")] if "." in base else base
    if not stem:
        raise ValueError(f"{name}: torch.save cannot use this file name (empty archive name)")
    return stem


@dataclass(frozen=True)
class ZipRecord:
    """One zip record: where its local header, data and data descriptor go."""

    name: str  # full name, "<archive>/<record>"
    header_offset: int
    header: bytes  # local header + name + extra fields
    size: int

    @property
    def zip64(self) -> bool:
        return self.size >= _U32 or self.header_offset >= _U32

    @property
    def data_offset(self) -> int:
        return self.header_offset + len(self.header)

    @property
    def descriptor_offset(self) -> int:
        return self.data_offset + self.size

    @property
    def flags(self) -> int:
        # UTF-8 names, plus "data descriptor follows" except for empty records (miniz skips it).
        return 0x0808 if self.size else 0x0800

    @property
    def end(self) -> int:
        if not self.size:
            return self.descriptor_offset
        return self.descriptor_offset + (24 if self.zip64 else 16)


@dataclass(frozen=True)
class ZipLayout:
    """Every offset of a torch.save file, computed from metadata only.

    ``records`` are in write order; ``small`` holds the contents known at plan time.
    """

    archive: str
    keys: tuple[str, ...]  # tensor keys in dict order ("" for a bare tensor)
    data_offset: dict[str, int]
    nbytes: dict[str, int]
    file_size: int
    storage_keys: dict[str, str]  # tensor key -> "<n>" of data/<n>
    records: tuple[ZipRecord, ...]
    small: dict[str, bytes]  # record name -> contents, for data.pkl .. byteorder and version
    central_dir_offset: int
    name_hash: int
    metas: dict[str, TensorMeta]

    def record_for(self, key: str) -> ZipRecord:
        return self.records[4 + int(self.storage_keys[key])]


def _zip64_extra(size: int, offset: int, local: bool) -> bytes:
    body = b""
    if size >= _U32:  # local headers carry a 0 compressed size (unknown when miniz writes them)
        body += struct.pack("<QQ", size, 0 if local else size)
    if offset >= _U32:
        body += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(body)) + body if body else b""


def _local_header(name: bytes, offset: int, size: int) -> bytes:
    z64 = _zip64_extra(size, offset, local=True)
    pad = -(offset + 30 + len(name) + len(z64) + 4) % _ALIGN  # data starts 64-aligned
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    flags = 0x0808 if size else 0x0800
    fixed = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return fixed + name + extra


def _central_entry(rec: ZipRecord, crc: int) -> bytes:
    name = rec.name.encode()
    extra = _zip64_extra(rec.size, rec.header_offset, local=False)
    size32 = min(rec.size, _U32)
    fixed = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, rec.flags, 0, 0, 0, crc, size32, size32,
                        len(name), len(extra), 0, 0, 0, 0, min(rec.header_offset, _U32))
    return fixed + name + extra


def _descriptor(rec: ZipRecord, crc: int) -> bytes:
    if not rec.size:
        return b""
    if rec.zip64:
        return struct.pack("<IIQQ", 0x08074B50, crc, rec.size, rec.size)
    return struct.pack("<IIII", 0x08074B50, crc, rec.size, rec.size)


def _end_records(n: int, cd_offset: int, cd_size: int) -> bytes:
    z64_offset = cd_offset + cd_size
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, z64_offset, 1)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                       min(cd_size, _U32), min(cd_offset, _U32), 0)
    return z64 + locator + eocd


def plan_zip(path_or_archive_name: str | os.PathLike[str],
             entries: Mapping[str, TensorMeta | Any] | TensorMeta) -> ZipLayout:
    """Layout of ``torch.save(entries, path)``; TensorMeta values (nested: TensorAt) stand for tensors.

    ``entries`` may also be a single TensorMeta, for ``torch.save(tensor)`` (its key is ``""``).

    >>> lay = plan_zip("out/model.pt", {"w": TensorMeta.contiguous(torch.float32, (2, 3))})
    >>> lay.archive, lay.nbytes["w"], lay.data_offset["w"] % 64
    ('model', 24, 0)
    """
    archive = archive_name_for(path_or_archive_name)
    pkl, storage_keys, metas = pickle_entries(entries)
    contents: list[tuple[str, bytes | None, int]] = [("data.pkl", pkl, len(pkl))]
    contents += [(n, c, len(c)) for n, c in _SMALL_RECORDS]
    contents += [(f"data/{storage_keys[k]}", None, metas[k].nbytes) for k in storage_keys]
    contents += [("version", _VERSION, len(_VERSION)), (".data/serialization_id", None, 40)]
    records, small, offset = [], {}, 0
    for short, data, size in contents:
        name = f"{archive}/{short}"
        rec = ZipRecord(name, offset, _local_header(name.encode(), offset, size), size)
        records.append(rec)
        if data is not None:
            small[name] = data
        offset = rec.end
    cd_size = sum(len(_central_entry(r, 0)) for r in records)
    by_key = {k: records[4 + i] for i, k in enumerate(storage_keys)}
    return ZipLayout(
        archive=archive, keys=tuple(storage_keys), data_offset={k: r.data_offset for k, r in by_key.items()},
        nbytes={k: r.size for k, r in by_key.items()}, file_size=offset + cd_size + _END_RECORDS_SIZE,
        storage_keys=dict(storage_keys), records=tuple(records), small=small, central_dir_offset=offset,
        name_hash=_record_name_hash(len(storage_keys)), metas=metas,
    )


# ----------------------------------------------------------------------------- writing
def _nothing() -> None:
    pass


def _byte_view(data: Any) -> memoryview:
    """Flat uint8 view of bytes-like data or a contiguous CPU tensor, without copying."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"extent tensor must be contiguous on cpu, got device {data.device}, "
                             f"contiguous={data.is_contiguous()}")
        if data.numel() == 0:
            return memoryview(b"")
        return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return memoryview(data).cast("B")




def pwrite_extent(fd: int, layout: ZipLayout, key: str, offset_in_record: int, data: Any) -> int:
    """Write an extent of ``key``'s record into an open fd (e.g. in a worker process); returns its CRC.

    Hand ``(key, offset_in_record, len, crc)`` to the owning writer's :meth:`TorchZipWriter.add_extent_crc`.

    >>> fd = os.open(path, os.O_WRONLY); crc = pwrite_extent(fd, layout, "w", 0, t)  # doctest: +SKIP
    """
    return _pwrite_view(fd, layout, "<fd>", key, offset_in_record, _byte_view(data))


def _pwrite_view(fd: int, layout: ZipLayout, path: str, key: str, offset_in_record: int, view: memoryview,
                 base: int = 0, digest: WriteDigest | None = None) -> int:
    _check_extent(layout, path, key, offset_in_record, len(view))
    crc = RunningCrc()
    write_to(fd, view, base + layout.data_offset[key] + offset_in_record, digest, crc)
    return crc.value


def _check_extent(layout: ZipLayout, path: str, key: str, offset: int, length: int) -> None:
    if key not in layout.nbytes:
        raise KeyError(f"{path}: no tensor {key!r} in this layout (keys: {list(layout.keys)[:5]}...)")
    if offset < 0 or offset + length > layout.nbytes[key]:
        raise ValueError(f"{path}: extent [{offset}, {offset + length}) of {key!r} is outside "
                         f"its record: expected within [0, {layout.nbytes[key]})")


def _combined_crc(path: str, key: str, nbytes: int, extents: list[tuple[int, int, int]]) -> int:
    """CRC of a record from its extents, which must tile [0, nbytes) exactly."""
    crc, pos = 0, 0
    for off, length, piece_crc in sorted(set(extents)):  # exact duplicates are harmless retries
        if off != pos:
            what = "missing" if off > pos else "written twice (overlapping extents)"
            lo, hi = min(off, pos), max(off, pos)
            raise ValueError(f"{path}: tensor {key!r}: bytes [{lo}, {hi}) {what}; "
                             f"expected extents tiling [0, {nbytes})")
        crc, pos = crc32_combine(crc, piece_crc, length), pos + length
    if pos != nbytes:
        raise ValueError(f"{path}: tensor {key!r}: bytes [{pos}, {nbytes}) missing; "
                         f"expected extents tiling [0, {nbytes})")
    return crc


class TorchZipWriter:
    """Writes a planned torch zip; tensor bytes arrive as extents, CRCs are combined at finish().

    >>> with TorchZipWriter("m.pt", plan_zip("m.pt", {"w": TensorMeta.of(t)})) as w:  # doctest: +SKIP
    ...     w.write_tensor("w", t)
    """

    def __init__(self, path: str | os.PathLike[str], layout: ZipLayout, *, fd: int | None = None,
                 base: int = 0, digest: WriteDigest | None = None) -> None:
        """With ``fd``, write the zip at offset ``base`` of a file someone else opened, sized and
        closes (several torch.save blobs in one file, as DCP's ``.distcp`` holds them), through that
        file's ``digest`` (ckptconv.io.write_digest) when it has one."""
        self.path, self.layout, self.base = os.fspath(path), layout, base
        self._extents: dict[str, list[tuple[int, int, int]]] = {k: [] for k in layout.keys}
        self._filled = dict.fromkeys(layout.keys, 0)  # bytes of each record written so far
        self._crcs: dict[str, int] = {}  # records whose data descriptor is written: their CRC
        self._unfilled = sum(1 for k in layout.keys if layout.nbytes[k])  # non-empty records not yet filled
        self._tail_written = False  # serialization_id and central directory
        self._lock = threading.Lock()
        self._finished = False
        self._owns_fd = fd is None
        self._fd = open_output(self.path, 0o666) if fd is None else fd
        self._digest = digest
        try:
            if fd is None:
                self._digest = open_digest(self.path, self._fd)
            if self._owns_fd:
                os.ftruncate(self._fd, layout.file_size)  # sparse preallocation to the exact size
            for rec in layout.records:
                self._write(memoryview(rec.header), rec.header_offset)
                if rec.name in layout.small:
                    data = layout.small[rec.name]
                    self._write(memoryview(data + _descriptor(rec, crc32(data))), rec.data_offset)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and not self._finished:
                self.finish()
        finally:
            self.close()

    def _write(self, view: memoryview, offset: int) -> None:
        """pwrite at ``offset`` of this zip (past ``base``), through the file's digest."""
        write_to(self._fd, view, self.base + offset, self._digest)

    def close(self) -> None:
        """Release the file without finishing it (finish() closes too); a borrowed fd stays open."""
        if self._fd >= 0 and self._owns_fd:
            close_output(self._fd)
        self._fd = -1

    def write_extent(self, key: str, offset_in_record: int, data: Any) -> int:
        """pwrite ``data`` at ``offset_in_record`` of ``key``'s record; returns and records its CRC.

        >>> w.write_extent("w", 0, t[:2].contiguous())  # doctest: +SKIP
        """
        view = _byte_view(data)
        crc = _pwrite_view(self._fd, self.layout, self.path, key, offset_in_record, view, self.base, self._digest)
        self._record_extent(key, offset_in_record, len(view), crc)
        return crc

    def file_offset(self, key: str, offset_in_record: int) -> int:
        """Where byte ``offset_in_record`` of ``key``'s record lies in the file."""
        return self.base + self.layout.data_offset[key] + offset_in_record

    def claim(self, key: str, offset_in_record: int, length: int) -> Callable[[], None]:
        """Announce that these bytes of ``key`` are being computed (ckptconv.io.write_digest.WriteDigest.claim);
        returns the release."""
        if self._digest is None:
            return _nothing
        start = self.file_offset(key, offset_in_record)
        end = start + length
        if offset_in_record + length == self.layout.nbytes[key]:  # the record's descriptor is written with its
            # last band to finish, and after the last record the zip's tail: that band's thread writes them
            end = self.base + (self.layout.file_size if key == self.layout.keys[-1] else self.layout.record_for(key).end)
        return self._digest.claim(start, end - start)

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``key``'s whole record from a tensor whose dtype, shape and stride match the plan.

        >>> w.write_tensor("w", torch.zeros(3, 2).t())  # doctest: +SKIP
        """
        expected = self._meta(key)
        actual = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if actual != (expected.dtype, expected.shape, expected.stride):
            raise ValueError(f"{self.path}: tensor {key!r}: expected dtype/shape/stride "
                             f"{(expected.dtype, expected.shape, expected.stride)}, got {actual}")
        if expected.numel == 0:
            return
        # A dense stride covers exactly [data_ptr, data_ptr + nbytes): take it in memory order.
        flat = tensor.detach().as_strided((expected.numel,), (1,), tensor.storage_offset())
        self.write_extent(key, 0, flat)

    def _meta(self, key: str) -> TensorMeta:
        if key not in self.layout.metas:
            raise KeyError(f"{self.path}: no tensor {key!r} in this layout")
        return self.layout.metas[key]

    def add_extent_crc(self, key: str, offset_in_record: int, length: int, crc: int) -> None:
        """Record an extent that someone else wrote at ``layout.data_offset[key] + offset_in_record``."""
        _check_extent(self.layout, self.path, key, offset_in_record, length)
        self._record_extent(key, offset_in_record, length, crc)

    def _record_extent(self, key: str, offset_in_record: int, length: int, crc: int) -> None:
        if not length:
            return
        with self._lock:
            self._extents[key].append((offset_in_record, length, crc & _U32))
            self._filled[key] += length
            extents = list(self._extents[key]) if self._filled[key] == self.layout.nbytes[key] else None
        if extents is not None:
            self._write_descriptor(key, extents)

    def _write_descriptor(self, key: str, extents: list[tuple[int, int, int]]) -> None:
        """A record just filled: its data descriptor now (and the zip's tail when it was the last), so a digest of
        the file in file order passes them without waiting for finish() (the same bytes finish() would write)."""
        rec = self.layout.record_for(key)
        try:
            crc = _combined_crc(self.path, key, rec.size, extents)
        except ValueError:
            return  # overlapping extents: finish() says so
        self._write(memoryview(_descriptor(rec, crc)), rec.descriptor_offset)
        with self._lock:
            self._crcs[key] = crc
            self._unfilled -= 1  # once per record: its filled count reaches its size exactly once
            last = not self._tail_written and self._unfilled == 0
            self._tail_written |= last
            crcs = dict(self._crcs) if last else {}
        if last:  # the zip's tail now too (a DCP item's, say, long before its file finishes)
            self._write_tail({k: crcs.get(k, 0) for k in self.layout.keys})

    def finish(self) -> None:
        """Check every tensor record is exactly tiled, then write descriptors, serialization_id and
        the central directory (unless written as the last record filled), and close the file."""
        if self._finished:
            return
        if self._fd < 0:
            raise ValueError(f"{self.path}: writer was closed before finish()")
        lay = self.layout
        with self._lock:
            done = dict(self._crcs)
            off_size = [key for key in lay.keys if self._filled[key] != lay.nbytes[key]]
        for key in off_size:  # a gap, or bytes written twice (also after the record's descriptor was written)
            _combined_crc(self.path, key, lay.nbytes[key], self._extents[key])
        if not self._tail_written:
            crcs = {key: done[key] if key in done else _combined_crc(self.path, key, lay.nbytes[key], self._extents[key])
                    for key in lay.keys}  # raises, naming the gap or overlap, before anything is written
            for key in lay.keys:
                if key not in done:  # not written as its record filled
                    rec = lay.record_for(key)
                    self._write(memoryview(_descriptor(rec, crcs[key])), rec.descriptor_offset)
            self._tail_written = True
            self._write_tail(crcs)
        if self._owns_fd and self._digest is not None:
            self._digest.finish()  # before the fd closes: it may read back ranges written out of order
        self._finished = True
        self.close()

    def _write_tail(self, record_crcs: dict[str, int]) -> None:
        """serialization_id and the central directory, from every tensor record's CRC (by key)."""
        lay = self.layout
        crcs = {n: crc32(d) for n, d in lay.small.items()}
        crcs.update({lay.record_for(key).name: crc for key, crc in record_crcs.items()})
        combined = 0
        for rec in lay.records[:-1]:
            if rec.size:  # torch leaves empty records out of this hash
                combined = _hash_combine(combined, crcs[rec.name])
        sid_rec = lay.records[-1]
        sid = f"{lay.name_hash:020d}{combined:020d}".encode()
        crcs[sid_rec.name] = crc32(sid)
        self._write(memoryview(sid + _descriptor(sid_rec, crcs[sid_rec.name])), sid_rec.data_offset)
        cd = b"".join(_central_entry(r, crcs[r.name]) for r in lay.records)
        tail = cd + _end_records(len(lay.records), lay.central_dir_offset, len(cd))
        self._write(memoryview(tail), lay.central_dir_offset)


def save_state_dict(path: str | os.PathLike[str], state_dict: Mapping[str, Any] | torch.Tensor) -> None:
    """``torch.save(state_dict, path)``, byte for byte, through plan_zip + TorchZipWriter.

    Every tensor must be a plain CPU tensor owning exactly its storage (offset 0, dense).

    >>> save_state_dict("m.pt", {"w": torch.zeros(2, 3).t().contiguous().t(), "step": 3})  # doctest: +SKIP
    """
    path = os.fspath(path)
    tensors = {"": state_dict} if isinstance(state_dict, torch.Tensor) else {
        k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    seen: dict[int, str] = {}
    for key, t in tensors.items():
        _check_savable(path, key, t, seen)
    if isinstance(state_dict, torch.Tensor):
        entries: Any = TensorMeta.of(state_dict)
    else:
        entries = type(state_dict)()
        if type(state_dict) is OrderedDict:
            entries.__dict__.update(vars(state_dict))
        for k, v in state_dict.items():
            entries[k] = TensorMeta.of(v) if isinstance(v, torch.Tensor) else v
    with TorchZipWriter(path, plan_zip(path, entries)) as writer:
        for key, t in tensors.items():
            writer.write_tensor(key, t)


def _check_savable(path: str, key: str, t: torch.Tensor, seen: dict[int, str]) -> None:
    """Reject tensors whose torch.save bytes would differ from what we write."""
    problem = None
    if type(t) is not torch.Tensor:
        problem = f"type {type(t).__name__} (expected plain torch.Tensor)"
    elif t.device.type != "cpu" or t.requires_grad or t.is_conj() or t.is_neg():
        problem = f"device {t.device}, requires_grad {t.requires_grad} (expected cpu, no grad, no conj/neg bit)"
    elif t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        problem = (f"storage offset {t.storage_offset()}, storage bytes {t.untyped_storage().nbytes()} "
                   f"(expected 0 and {t.numel() * t.element_size()}: the tensor must own exactly its storage)")
    else:
        storage_id = t.untyped_storage()._cdata
        if storage_id in seen:
            problem = f"shares its storage with {seen[storage_id]!r}"
        seen[storage_id] = key
    if problem:
        raise ValueError(f"{path}: tensor {key!r}: {problem}")

"""torch.distributed.checkpoint (DCP) directories: a lazy reader and the executor's writer.

What a DCP directory is (torch 2.x ``FileSystemWriter``/``FileSystemReader``, format "1.0.0"):

* ``.metadata``: a pickle of ``Metadata``: for every flat key, a ``TensorStorageMetadata`` (dtype,
  global size, chunks: offsets and sizes) or a ``BytesStorageMetadata``; ``storage_data`` maps each
  chunk (``MetadataIndex(fqn, offset)``) to ``_StorageInfo(relative_path, offset, length)``;
  ``planner_data`` maps each flat key to its path in the nested state dict.
* ``__<rank>_<n>.distcp`` files: items one after another, each ``torch.save`` of one tensor chunk
  (a complete torch zip whose records are named ``archive/...``, as for any stream), or for a
  bytes item the bytes of ``torch.save(value)``.

The writer computes every item's place from shapes alone (:func:`layout_items`), writes tensor bytes
as bands arrive (no item is ever whole in memory), and the ``.metadata`` from the same layout. The
reader reads rows of any key lazily from its chunks; with records (a ``ckptconv.json`` beside it)
every byte it reads is checked against the file's digest and each item's zip CRC-32s.

    >>> ckpt = DcpCheckpoint("step-100")                          # doctest: +SKIP
    >>> ckpt.read_rows(Source(None, "norm.weight"), 0, 1)          # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.plan import OutFile, Source
from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles, ZipCrc, check_whole_file
from ckptconv.io.direct_io import close_output, open_output
from ckptconv.io.metadata import read_metadata
from ckptconv.io.positional import FileWindow, PositionalFile
from ckptconv.io.safe_load import DcpRecord, load_dcp_metadata, load_small_bytes
from ckptconv.io.torchzip import TensorMeta, TorchZipReader, TorchZipWriter, ZipLayout, plan_zip
from ckptconv.io.write_digest import open_digest, write_to

METADATA = ".metadata"
SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION for the layout written here
ITEM_ARCHIVE = "archive"  # torch.save into a stream names its records "archive/..."
_STEP_DIR = re.compile(r"step-(\d+)$")


def distcp_name(index: int) -> str:
    """Name of the ``index``-th data file (rank 0's, as one process of DCP's writer names them)."""
    return f"__0_{index}{SUFFIX}"


# --------------------------------------------------------------------------------------------
# Layout: every item's place, from shapes alone


@dataclass(frozen=True)
class Item:
    """One item of a ``.distcp`` file: a whole tensor (``zip``) or a small value (``payload``)."""

    key: str
    file: str
    offset: int
    length: int
    zip: ZipLayout | None = None
    payload: bytes | None = None
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


def value_bytes(value: Any) -> bytes:
    """A bytes item's content: ``torch.save(value)`` as DCP writes it (plain values only)."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def layout_items(files: list[OutFile], values: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, list[Item]]:
    """Items of every file: its small values first (as DCP's writer puts them), then its tensors in
    order, each a contiguous ``torch.save(tensor)`` blob placed right after the previous one."""
    out: dict[str, list[Item]] = {}
    for f in files:
        items, offset = [], 0
        for key, value in (values or {}).get(f.path, {}).items():
            payload = value_bytes(value)
            items.append(Item(key, f.path, offset, len(payload), payload=payload))
            offset += len(payload)
        for t in f.tensors:
            if t.column_major:
                raise AssertionError(f"{t.key}: DCP items are stored row-major")
            zl = plan_zip(ITEM_ARCHIVE, TensorMeta.contiguous(t.dtype, t.shape))
            items.append(Item(t.key, f.path, offset, zl.file_size, zip=zl, dtype=t.dtype, shape=t.shape))
            offset += zl.file_size
        out[f.path] = items
    return out


def encode_metadata(items: Mapping[str, list[Item]], planner_path: Callable[[str], tuple[str, ...]],
                    save_id: str) -> bytes:
    """The ``.metadata`` pickle of torch's own classes for these items (one chunk per tensor)."""
    from ckptconv.io.dcp_classes import dumps, metadata_classes  # not torch's DCP package: ~0.5 s of start-up

    c = metadata_classes()
    (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
     TensorStorageMetadata, _StorageInfo) = (c.BytesStorageMetadata, c.ChunkStorageMetadata, c.Metadata, c.MetadataIndex,
                                             c.StorageMeta, c.TensorProperties, c.TensorStorageMetadata, c.StorageInfo)

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for file_items in items.values():
        for item in file_items:
            if item.zip is None:
                state[item.key] = BytesStorageMetadata()
                index = MetadataIndex(item.key)
            else:
                size = torch.Size(item.shape)
                origin = torch.Size([0] * len(item.shape))
                assert item.dtype is not None
                state[item.key] = TensorStorageMetadata(TensorProperties(dtype=item.dtype), size,
                                                        [ChunkStorageMetadata(origin, size)])
                index = MetadataIndex(item.key, origin, 0)
            storage[index] = _StorageInfo(item.file, item.offset, item.length)
    planner = {key: planner_path(key) for key in state}
    meta = Metadata(state, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=save_id), version=DCP_VERSION)
    return dumps(meta)


def save_id_of(fingerprint: str) -> str:
    """A uuid-shaped save id derived from the conversion's fingerprint (the same input writes the same bytes)."""
    h = hashlib.sha256(fingerprint.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class DistcpSink:
    """One ``.distcp`` file being written: values at once, tensor bands as they arrive."""

    def __init__(self, out_file: OutFile, tmp: Path, items: list[Item]) -> None:
        self.path = tmp / out_file.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = sum(item.length for item in items)
        self._fd = open_output(self.path)
        self._digest = None
        self._writers: dict[str, TorchZipWriter] = {}
        try:
            self._digest = open_digest(self.path, self._fd)  # one per file, shared by its items' writers
            os.ftruncate(self._fd, size)
            for item in items:
                if item.zip is None:
                    assert item.payload is not None
                    write_to(self._fd, memoryview(item.payload), item.offset, self._digest)
                else:
                    self._writers[item.key] = TorchZipWriter(self.path, item.zip, fd=self._fd, base=item.offset,
                                                             digest=self._digest)
        except BaseException:
            close_output(self._fd)
            raise

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        self._writers[key].write_extent("", offset, data)  # thread-safe: positional writes

    def file_offset(self, key: str, offset: int) -> int:
        return self._writers[key].file_offset("", offset)

    def claim(self, key: str, offset: int, nbytes: int) -> Callable[[], None]:
        return self._writers[key].claim("", offset, nbytes)

    def finish(self) -> list[Path]:
        try:
            for writer in self._writers.values():
                writer.finish()
            if self._digest is not None:
                self._digest.finish()
        finally:
            close_output(self._fd)
        return [self.path]


def sink_factory(items: Mapping[str, list[Item]]):  # type: ignore[no-untyped-def]
    """The executor's sink factory for ``.distcp`` files laid out by :func:`layout_items`."""

    def make(out_file: OutFile, tmp: Path) -> DistcpSink:
        return DistcpSink(out_file, tmp, items[out_file.path])

    return make


# --------------------------------------------------------------------------------------------
# Reading


def step_dirs(root: Path, *, completed: bool = False) -> list[tuple[int, Path]]:
    """(N, directory) of a TorchTitan checkpoint folder's ``step-N`` saves, by step; ``completed``: only those
    holding ``.metadata`` (DCP renames it into place last, after every data file: TorchTitan's own test)."""
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    return [(n, p) for n, p in found if (p / METADATA).is_file()] if completed else found


def resolve_dcp(path: str | Path) -> tuple[Path, str]:
    """(the DCP directory, how it was found): PATH itself when it holds ``.metadata``, else its
    newest ``step-N`` subdirectory that does (a TorchTitan checkpoint folder).

    A ``step-N`` newer than the one taken that has no ``.metadata`` (DCP writes it last: a save still running
    or one that died) is skipped, and ``how`` says so.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: no such directory" if not path.exists() else f"{path}: expected a DCP directory")
    if (path / METADATA).is_file():
        return path, "directory"
    found = step_dirs(path)
    steps = [(n, p) for n, p in found if (p / METADATA).is_file()]
    newest = steps[-1][0] if steps else -1
    unfinished = [p.name for n, p in found if n > newest and not (p / METADATA).is_file()]
    said = (f"; skipped the unfinished save{'s' if len(unfinished) > 1 else ''} {', '.join(unfinished)} (no "
            f"{METADATA}: DCP writes it last)") if unfinished else ""
    if steps:
        return steps[-1][1], f"newest checkpoint {steps[-1][1].name}{said}"
    if unfinished:
        raise ConversionError(f"{path}: no finished checkpoint: {', '.join(unfinished)} ha{'ve' if len(unfinished) > 1 else 's'} "
                              f"no {METADATA} (an unfinished save: DCP writes it last)")
    raise ConversionError(f"{path}: not a DCP checkpoint (no {METADATA}, and no step-N directory holding one)")


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Entry:
    """A key of the checkpoint: a tensor (dtype, size, chunks) or a bytes item (one chunk, no dtype)."""

    key: str
    dtype: torch.dtype | None
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


def _plain_file(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ConversionError(f"{where}: storage file must be a plain name inside the checkpoint, got {name!r}")
    return name


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise ConversionError(f"{what}: expected a tuple of non-negative ints, got {value!r}")
    return tuple(value)


def parse_metadata(data: bytes, name: str) -> dict[str, Entry]:
    """The entries of a ``.metadata`` pickle (read through the allowlisted unpickler), validated."""
    try:
        return _entries(load_dcp_metadata(data, name), name)
    except (AttributeError, TypeError) as exc:  # a field missing or of the wrong kind
        raise ConversionError(f"{name}: not a DCP metadata file this reader knows ({exc})") from None


def _entries(meta: Any, name: str) -> dict[str, Entry]:
    if not isinstance(meta, DcpRecord) or meta.kind != "Metadata":
        raise ConversionError(f"{name}: not a DCP Metadata object")
    keys, storage = getattr(meta, "state_dict_metadata", None), getattr(meta, "storage_data", None)
    if not isinstance(keys, dict) or not isinstance(storage, dict):
        raise ConversionError(f"{name}: needs state_dict_metadata and storage_data (a FileSystemWriter checkpoint)")
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in storage.items():
        if not (isinstance(index, DcpRecord) and index.kind == "MetadataIndex" and isinstance(info, DcpRecord)
                and info.kind == "_StorageInfo"):
            raise ConversionError(f"{name}: storage_data must map MetadataIndex to _StorageInfo")
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{name}: {index.fqn!r} is stored through transforms "
                                  f"{info.transform_descriptors}; only plain items are supported")
        offset = getattr(index, "offset", None)
        where[(index.fqn, None if offset is None else _ints(tuple(offset), f"{name}: {index.fqn!r} offset"))] = info
    entries: dict[str, Entry] = {}
    for key, md in keys.items():
        if not isinstance(key, str) or not isinstance(md, DcpRecord):
            raise ConversionError(f"{name}: bad entry {key!r}")
        if md.kind == "BytesStorageMetadata":
            info = where.get((key, None))
            if info is None:
                raise ConversionError(f"{name}: {key!r} has no storage entry")
            chunk = Chunk((), (), _plain_file(info.relative_path, name), info.offset, info.length)
            entries[key] = Entry(key, None, (), (chunk,))
            continue
        if md.kind != "TensorStorageMetadata" or not isinstance(md.properties.dtype, torch.dtype):
            raise ConversionError(f"{name}: {key!r} is a {md.kind}, expected tensor or bytes storage metadata")
        size = _ints(tuple(md.size), f"{name}: {key!r} size")
        chunks = []
        for c in md.chunks:
            offsets, sizes = _ints(tuple(c.offsets), f"{name}: {key!r}"), _ints(tuple(c.sizes), f"{name}: {key!r}")
            info = where.get((key, offsets))
            if info is None:
                raise ConversionError(f"{name}: {key!r} chunk at {list(offsets)} has no storage entry")
            chunks.append(Chunk(offsets, sizes, _plain_file(info.relative_path, name), info.offset, info.length))
        _check_tiling(name, key, size, chunks)
        entries[key] = Entry(key, md.properties.dtype, size, tuple(chunks))
    return entries


def _check_tiling(name: str, key: str, size: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks lie inside the tensor and cover it exactly once."""
    total = 0
    for c in chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size) or any(
                o + s > n for o, s, n in zip(c.offsets, c.sizes, size, strict=True)):
            raise ConversionError(f"{name}: {key!r} chunk at {list(c.offsets)} size {list(c.sizes)} lies outside {list(size)}")
        total += math.prod(c.sizes)
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if all(max(x, y) < min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise ConversionError(f"{name}: {key!r} chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
    if total != math.prod(size):
        raise ConversionError(f"{name}: {key!r} chunks cover {total} of {math.prod(size)} elements")


class DcpCheckpoint:
    """A DCP directory opened lazily; implements the executor's ``TensorReader`` (``Source(None, key)``).

    With ``check`` and a ``ckptconv.json`` beside it, ``.metadata`` is checked whole and every data
    file against its digest as it is read (``finish_checks``); without one, each item's zip CRC-32s.
    """

    def __init__(self, path: str | Path, *, io: str = "read", check: bool = True) -> None:
        self.root, self.found_as = resolve_dcp(path)
        self.io = io
        self.metadata = read_metadata(self.root)
        self.checks = CheckedFiles(self.root, None if self.metadata is None else self.metadata.files, enabled=check)
        meta_path = self.root / METADATA
        data = check_whole_file(meta_path, self.checks.record(meta_path) if check else None)
        self.entries = parse_metadata(data, str(meta_path))
        self._files: dict[str, PositionalFile] = {}
        self._items: dict[tuple[str, int], TorchZipReader] = {}
        self._lock = threading.Lock()
        try:
            self._open_items()
        except BaseException:
            self.close()
            raise

    def _open_items(self) -> None:
        """Parse every tensor item's zip directory now: its dtype and shape must be its chunk's, and
        its record CRCs go to the file's check before any byte of it is read."""
        records: dict[str, list[ZipCrc]] = {}
        for entry in self.entries.values():
            if not entry.is_tensor:
                continue
            for chunk in entry.chunks:
                reader = self._item(chunk)
                stored = reader.entry(reader.keys()[0]) if reader.keys() == [""] else None
                if stored is None or not hasattr(stored, "dtype"):
                    raise ConversionError(f"{self.root / chunk.file}: item of {entry.key!r} at {chunk.offset} is not "
                                          "one torch.save'd tensor")
                if stored.dtype != entry.dtype or tuple(stored.shape) != chunk.sizes:
                    raise ConversionError(f"{self.root / chunk.file}: item of {entry.key!r} holds {stored.dtype} "
                                          f"{list(stored.shape)}; {METADATA} says {entry.dtype} {list(chunk.sizes)}")
                records.setdefault(chunk.file, []).extend(
                    ZipCrc(r.name, chunk.offset + r.start, r.size, r.crc) for r in reader.zip_records())
        for file, recs in records.items():
            check = self._files[file].check
            if check is not None:
                check.set_zip_records(recs)

    def _file(self, name: str) -> PositionalFile:
        with self._lock:
            if name not in self._files:
                path = self.root / name
                if not path.is_file():
                    raise ConversionError(f"{path}: missing; {self.root / METADATA} stores items in it")
                need = max(c.offset + c.length for e in self.entries.values() for c in e.chunks if c.file == name)
                if (size := path.stat().st_size) < need:
                    raise ConversionError(f"{path}: {size} bytes, but {self.root / METADATA} stores items in it up "
                                          f"to byte {need}: a truncated file (an unfinished save, or an incomplete "
                                          "copy); convert an earlier step-N, or copy the checkpoint again")
                f = PositionalFile(str(path), self.io)
                f.check = self.checks.open(path, f.copy_into)
                self._files[name] = f
            return self._files[name]

    def _item(self, chunk: Chunk) -> TorchZipReader:
        key = (chunk.file, chunk.offset)
        if key not in self._items:
            base = self._file(chunk.file)
            window = FileWindow(base, chunk.offset, chunk.length, f"{base.path}@{chunk.offset}")
            self._items[key] = TorchZipReader(window.path, checks=self.checks, source=window)
        return self._items[key]

    # -- what it holds ----------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise ConversionError(f"{self.root}: no key {key!r} in {METADATA}") from None

    def read_value(self, key: str) -> Any:
        """A bytes item's value (``torch.load(weights_only=True)`` of its bytes)."""
        entry = self.entry(key)
        if entry.is_tensor:
            raise ConversionError(f"{self.root}: {key!r} is a tensor, not a value")
        chunk = entry.chunks[0]
        data = bytearray(chunk.length)
        self._file(chunk.file).read_into(chunk.offset, memoryview(data))
        return load_small_bytes(bytes(data), f"{self.root / chunk.file}@{chunk.offset} ({key})")

    # -- TensorReader ----------------------------------------------------------------------

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        entry = self.entry(source.key)
        if entry.dtype is None:
            raise ConversionError(f"{self.root}: {source.key!r} is a value, not a tensor")
        return entry.dtype, entry.size, False

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of dim 0, assembled from every chunk they cross."""
        entry = self.entry(source.key)
        dtype, size = self.info(source)[:2]
        rows_total = size[0] if size else 1
        if not 0 <= start <= stop <= rows_total:
            raise ValueError(f"{self.root}: {source.key!r}: rows [{start}, {stop}) outside [0, {rows_total}]")
        shape = (stop - start, *size[1:]) if size else (1,)
        result = torch.empty(shape, dtype=dtype) if out is None else out.view(shape)
        if len(entry.chunks) == 1:  # the whole tensor (the tiling was checked)
            return self._item(entry.chunks[0]).read_rows("", start, stop, result)
        for chunk in entry.chunks:
            lo, hi = max(start, chunk.offsets[0]), min(stop, chunk.offsets[0] + chunk.sizes[0])
            if lo >= hi:
                continue
            part = self._item(chunk).read_rows("", lo - chunk.offsets[0], hi - chunk.offsets[0])
            index = (slice(lo - start, hi - start),) + tuple(
                slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True))
            result[index].copy_(part)
        return result

    def read_slab_rows(self, source: Source, slab: int, start: int, stop: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of one slab of a stacked tensor (an expert's matrix): only their bytes when one chunk
        holds the whole slab (else the slab is assembled whole and cut)."""
        entry = self.entry(source.key)
        for chunk in entry.chunks:
            first = chunk.offsets[0]
            if first <= slab < first + chunk.sizes[0] and tuple(chunk.sizes[1:]) == tuple(entry.size[1:]):
                return self._item(chunk).read_slab_rows("", slab - first, start, stop, out)
        rows = self.read_rows(source, slab, slab + 1)[0, start:stop]
        return rows if out is None else out.copy_(rows)

    def position(self, source: Source) -> int:
        """Where a key's first chunk starts in its file (reads then go front to back)."""
        return self.entry(source.key).chunks[0].offset

    def dtypes(self) -> dict[str, torch.dtype]:
        return {k: e.dtype for k, e in self.entries.items() if e.dtype is not None}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: e.size for k, e in self.entries.items() if e.dtype is not None}

    def data_files(self) -> list[Path]:
        return sorted({self.root / c.file for e in self.entries.values() for c in e.chunks})

    def finish_checks(self, *, workers: int = 8) -> int:
        """Complete the checks of every file read from; raise IntegrityError naming the first bad one."""
        return self.checks.finish(workers=workers)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._items.clear()

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


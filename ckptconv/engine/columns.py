"""Tensors cut by columns from shared sources (every tp rank's ``down_proj`` and ``o_proj`` at to-nxd, the HF
matrix of each at to-hf): grouped into one unit per set of source matrices, whose bands read each source band once
and feed every tensor of the unit (ckptconv.engine.execute runs them)."""

from __future__ import annotations

from typing import Protocol

import torch

from ckptconv.core.plan import OutTensor, Source
from ckptconv.engine.arena import SCRATCH
from ckptconv.engine.claims import row_bytes
from ckptconv.io.readers import try_read_columns


class Rows(Protocol):
    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]: ...

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


ColumnGroup = tuple[list[tuple[int, OutTensor]], int, int, int]  # (file index, tensor)s, rows, band rows, row bytes


def column_groups(
    by_source: dict[Source, list[tuple[int, OutTensor]]], reader: Rows, band_bytes: int
) -> list[ColumnGroup]:
    """Group column-split tensors that share any source (union-find over sources)."""
    parent: dict[Source, Source] = {}

    def find(s: Source) -> Source:
        while parent.setdefault(s, s) != s:
            s = parent[s]
        return s

    for items in by_source.values():
        for _, tensor in items:
            sources = [p.source for p in tensor.pieces]
            for s in sources[1:]:
                parent[find(s)] = find(sources[0])
    groups: dict[Source, list[tuple[int, OutTensor]]] = {}
    for first, items in by_source.items():
        groups.setdefault(find(first), []).extend(items)
    units = []
    for items in groups.values():
        rows = items[0][1].shape[0]
        if any(t.shape[0] != rows for _, t in items):
            raise AssertionError(f"column-split tensors {[t.key for _, t in items]} differ in rows")
        infos = [reader.info(s) for s in {p.source for _, t in items for p in t.pieces}]
        per_row = sum(row_bytes(shape, dtype.itemsize) for dtype, shape, _ in infos)
        # a column-major source's rows are gathered a run per column, then transposed (io.torchzip_read)
        per_row += sum(2 * row_bytes(shape, dtype.itemsize) for dtype, shape, cm in infos if cm)
        per_row += sum(row_bytes(t.shape, t.dtype.itemsize) * 2 for _, t in items)
        whole = any(t.column_major for _, t in items)
        band_rows = rows if whole else max(1, band_bytes // max(per_row, 1))
        units.append((items, rows, band_rows, per_row))
    return units


def column_band(
    tensor: OutTensor, start: int, stop: int, reader: Rows, cache: dict[Source, torch.Tensor],
    phase: int | None = None,
) -> torch.Tensor:
    """Output rows [start, stop) from column blocks of shared source bands (each read once), in a buffer at
    ``phase`` (see Scratch.get)."""
    for piece in tensor.pieces:
        if piece.source not in cache:
            dtype, shape, _ = reader.info(piece.source)
            cache[piece.source] = reader.read_rows(piece.source, start, stop,
                                                   out=SCRATCH.get(dtype, (stop - start, *shape[1:])))
    first = cache[tensor.pieces[0].source]
    band = SCRATCH.get(first.dtype, (stop - start, *tensor.shape[1:]), phase)
    column = 0
    for piece in tensor.pieces:
        band[:, column:column + piece.length].copy_(cache[piece.source][:, piece.start:piece.stop])
        column += piece.length
    return band


def transposed_rows(tensor: OutTensor, reader: Rows, band_bytes: int) -> tuple[int, int, int] | None:
    """(rows, band rows, bytes per row) of a column-major tensor cut by columns (NxD's ``o_proj`` with QKV linear),
    banded by its stored rows: each band is a block of its sources' columns, so neither the source matrix nor the
    tensor is ever held whole (a column-major source, another layout's shard, is read whole rows at a time: once per
    band). None where its pieces permute, average or pad: such a tensor is built whole, with the others cut from its
    sources."""
    if not (tensor.column_major and tensor.dim == 1 and len(tensor.shape) == 2):
        return None
    if any(p.row_perm or p.alternates or p.zeros for p in tensor.pieces):
        return None
    infos = [reader.info(p.source) for p in tensor.pieces]
    if any(len(shape) != 2 for _, shape, _ in infos) or len({dtype for dtype, _, _ in infos}) > 1:
        return None  # (a band is read in its sources' one dtype)
    itemsize = max(dtype.itemsize for dtype, _, _ in infos)
    # a band's buffers, per stored row: the block, a piece's part of it, the whole rows a reader without column reads
    # is read through (a column-major source's gathered a run per column, then transposed), the cast where the dtype
    # changes, the transpose
    sources = 5 if any(cm for _, _, cm in infos) else 3
    outputs = 1 + any(dtype != tensor.dtype for dtype, _, _ in infos)
    per_row = tensor.shape[0] * (sources * itemsize + outputs * tensor.dtype.itemsize)
    return tensor.shape[1], max(1, band_bytes // per_row), per_row


def column_block(tensor: OutTensor, start: int, stop: int, reader: Rows) -> torch.Tensor:
    """Columns [start, stop) of a tensor cut by columns (its stored rows when column-major), read as column blocks
    of its sources (:func:`transposed_rows`)."""
    dtype = reader.info(tensor.pieces[0].source)[0]
    band = SCRATCH.get(dtype, (tensor.shape[0], stop - start))
    column = 0
    for piece in tensor.pieces:
        lo, hi = max(start, column), min(stop, column + piece.length)
        if lo < hi:
            whole = hi - lo == stop - start  # the band is one piece's: read straight into it
            part = band if whole else SCRATCH.get(dtype, (tensor.shape[0], hi - lo))
            _read_columns(reader, piece.source, piece.start + lo - column, piece.start + hi - column, part)
            if not whole:
                band[:, lo - start:hi - start].copy_(part)
        column += piece.length
    return band


def _read_columns(reader: Rows, source: Source, lo: int, hi: int, out: torch.Tensor) -> None:
    """Columns [lo, hi) of the matrix ``source`` into ``out``: only those bytes where the reader can
    (``read_columns``), else whole rows, as many at a time as ``out`` holds bytes, each cut to its columns (a
    small budget then reads the matrix once per block of columns)."""
    if try_read_columns(reader, source, lo, hi, out):
        return
    dtype, (rows, columns), _ = reader.info(source)
    step = max(1, out.numel() // max(columns, 1))
    chunk = SCRATCH.get(dtype, (min(step, rows), columns))
    for row in range(0, rows, step):
        n = min(step, rows - row)
        reader.read_rows(source, row, row + n, out=chunk[:n])
        out[row:row + n].copy_(chunk[:n, lo:hi])

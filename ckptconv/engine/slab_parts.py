"""Slab bands cut into parts, so that a stacked expert group keeps to a worker's share of ``--max-memory``.

A slab group (:mod:`ckptconv.engine.slabs`) builds one slab index of every tensor of the group per band: an expert's
source matrix and every tp rank's slab of it. When that is more than a worker's share of the budget, each slab is
cut into parts: part ``j`` of ``n`` is stored rows ``[R*j//n, R*(j+1)//n)`` of every tensor's slab (one extent of its
file), and its sources are read in chunks of stored rows, each chunk once for every tensor of the group that needs
it. Rows within a slab are read alone where the reader can (``read_slab_rows``: safetensors, torch zip shards); else
that slab is read whole (one expert matrix, counted in the part's bytes). A smaller budget costs more parts and, for
sources cut by columns (a transposed piece), more reads of the same rows; never more memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ckptconv.core.plan import OutTensor, Piece, Source
from ckptconv.engine.slabs import (
    PAGE,
    Alloc,
    Rows,
    Scratch3,
    ScratchSizes,
    SlabBands,
    build_slabs,
    copy_compact,
    copy_scratch,
    nbytes_of,
    scratch_nbytes,
    slab_bands,
    slab_shape,
)
from ckptconv.io.transpose import native_dtype, transpose_into, whole_tiles


@dataclass(frozen=True)
class Parts:
    """How a group's slabs are cut: ``count`` parts per slab; ``chunk``: source rows read at once per (source,
    slab); ``buffer``: the bytes of the part's three scratch matrices (the chunk read and, where torch transposes, a
    compacted source and a target: :func:`_part_scratch`); ``nbytes``: the most one part takes from the allocator."""

    count: int
    chunk: dict[tuple[Source, int], int]
    buffer: ScratchSizes
    nbytes: int


@dataclass(frozen=True)
class SlabWork:
    """A slab group's bands: whole slabs (``parts`` None) or parts of them."""

    bands: SlabBands
    parts: Parts | None

    @property
    def per_slab(self) -> int:
        return self.parts.count if self.parts is not None else 1

    @property
    def nbytes(self) -> int:
        return self.parts.nbytes if self.parts is not None else self.bands.nbytes


def slab_work(tensors: list[OutTensor], reader: Rows, share: int) -> SlabWork:
    """How to build ``tensors`` (one slab group) within ``share`` bytes a band: whole slabs when one fits, else
    parts of them (:func:`plan_parts`); and a slab as one part even where it fits whole, when the part reads its
    sources in chunks smaller than their matrices and so saves at least half of the source matrices a whole band
    reads (an expert's down_proj for every tp rank, to-nxd; its gate and up from NxD's gate_up_proj slabs, to-hf):
    every byte is still read once, in less memory (Mixtral to-hf at a 512 MiB share: 718 MiB peak RSS where whole
    bands took 1135, and 7% less CPU, measured)."""
    bands = slab_bands(tensors, reader)
    if bands.nbytes <= share and not bands.sources:
        return SlabWork(bands, None)
    parts = plan_parts(tensors, bands.pieces, reader, share)
    if bands.nbytes <= share and not (parts is not None and parts.count == 1 and _chunked(parts, reader)
                                      and parts.nbytes + bands.sources // 2 <= bands.nbytes):
        parts = None
    return SlabWork(bands, parts)


def _chunked(parts: Parts, reader: Rows) -> bool:
    """Whether ``parts`` reads some source in chunks of fewer rows than its matrix (a large expert matrix)."""
    return any(rows < reader.info(source)[1][-2] for (source, _), rows in parts.chunk.items())


def plan_parts(tensors: list[OutTensor], split: list[list[list[Piece]]], reader: Rows, share: int) -> Parts | None:
    """The parts that keep a band of ``tensors`` (split by slab in ``split``) within ``share`` bytes: sources read
    in chunks of about a 32nd of it (a read of a few MB is as fast as a larger one), with the scratch those chunks
    take (:func:`_part_scratch`), the outputs' part in the rest (at least half); None for a group of other than
    matrices."""
    shapes = [slab_shape(t) for t in tensors]
    if any(len(shape) != 2 for shape in shapes):
        return None
    widest = max(t.dtype.itemsize for t in tensors)
    goal = max(share // 32, 1)
    chunk: dict[tuple[Source, int], int] = {}
    for pieces in split:
        for piece in (p for slab in pieces for p in slab):
            if piece.zeros or piece.alternates or piece.row_perm:
                return None
            if (piece.source, piece.slab) in chunk:
                continue
            dtype, shape, column_major = reader.info(piece.source)
            matrix = shape[1:] if piece.slab >= 0 else shape
            if len(matrix) != 2 or column_major:
                return None
            row = matrix[1] * max(dtype.itemsize, widest)
            whole = piece.slab >= 0 and not hasattr(reader, "read_slab_rows")
            chunk[(piece.source, piece.slab)] = matrix[0] if whole else max(1, min(matrix[0], whole_tiles(goal // row)))
    fewest = min(shape[0] for shape in shapes)  # a part has at least a row of every tensor

    def outputs(count: int) -> int:  # the largest part's outputs: ceil(rows / count) rows of each
        return sum(nbytes_of(t.dtype, (-(-shape[0] // count), shape[1])) + PAGE
                   for t, shape in zip(tensors, shapes, strict=True))

    def room(buffer: ScratchSizes) -> int:
        return max(share - scratch_nbytes(buffer), share // 2)

    count = max(1, min(-(-outputs(1) // room(_part_scratch(tensors, split, reader, chunk, 1))), fewest))
    buffer = _part_scratch(tensors, split, reader, chunk, count)  # (a whole slab's columns may be transposed at once)
    while outputs(count) > room(buffer) and count < fewest:
        count += 1
        buffer = _part_scratch(tensors, split, reader, chunk, count)
    return Parts(count, chunk, buffer, outputs(count) + scratch_nbytes(buffer))


def _part_scratch(tensors: list[OutTensor], split: list[list[list[Piece]]], reader: Rows,
                  chunk: dict[tuple[Source, int], int], count: int) -> ScratchSizes:
    """The most bytes of each scratch matrix a part takes, its slabs cut in ``count`` parts and its sources read
    ``chunk`` rows at a time (:func:`_source_scratch`), on shape-only (meta) views of the jobs of the first and the
    last (largest) part, once per distinct layout of a slab index."""
    most: ScratchSizes = (0, 0, 0)
    seen = set()
    for k in range(len(split[0])):
        order: dict[tuple[Source, int], int] = {}  # which pieces share a source matrix, by first appearance
        layout = tuple(tuple((order.setdefault((p.source, p.slab), len(order)), p.start, p.length, p.transposed,
                              reader.info(p.source), chunk[(p.source, p.slab)]) for p in pieces[k]) for pieces in split)
        if layout in seen:
            continue
        seen.add(layout)
        for part in {0, count - 1}:
            jobs: dict[tuple[Source, int], list[_Job]] = {}
            for tensor, pieces in zip(tensors, split, strict=True):
                rows, cols = slab_shape(tensor)
                first, stop = _part_rows(rows, part, count)
                out = torch.empty((stop - first, cols), dtype=tensor.dtype, device="meta")
                for piece, job in _regions(tensor, pieces[k], out, first, stop):
                    jobs.setdefault((piece.source, piece.slab), []).append(job)
            for (source, index), todo in jobs.items():
                sizes = _source_scratch(reader, source, index, todo, chunk[(source, index)])
                most = tuple(map(max, most, sizes))  # type: ignore[assignment]
    return most


Phase = Callable[[int, int, int], int | None]  # (tensor index, byte offset in it, bytes) -> a page phase or None


def slab_writes(work: SlabWork, tensors: list[OutTensor], band: int, reader: Rows, get: Alloc,
                phase: Phase | None = None) -> list[tuple[int, torch.Tensor]]:
    """Band ``band`` of a slab group (slab ``band // per_slab``, its part ``band % per_slab``): for each tensor, the
    byte offset in the tensor and the bytes to write there, built in buffers from ``get``; each at the page phase
    ``phase`` gives for its extent, so that an O_DIRECT write sends it from where it was built."""
    slab, part = divmod(band, work.per_slab)
    extents = slab_extents(work, tensors, band)
    phases = [phase(n, offset, nbytes) if phase else None for n, (offset, nbytes) in enumerate(extents)]
    if work.parts is None:
        built = build_slabs(tensors, slab, reader, get, work.bands.pieces, work.bands.scratch[slab], phases)
        return [(extent[0], b.unsqueeze(0) if t.slabs else b) for t, b, extent in zip(tensors, built, extents, strict=True)]
    parts = build_part(tensors, work.bands.pieces, slab, part, work.parts, reader, get, phases)
    return [(extent[0], rows) for extent, rows in zip(extents, parts, strict=True)]


def slab_extents(work: SlabWork, tensors: list[OutTensor], band: int) -> list[tuple[int, int]]:
    """(byte offset in the tensor, bytes) that band ``band`` of a slab group writes of each of ``tensors``."""
    slab, part = divmod(band, work.per_slab)
    extents = []
    for tensor in tensors:
        rows, cols = slab_shape(tensor)[0], nbytes_of(tensor.dtype, slab_shape(tensor)[1:])
        first, stop = _part_rows(rows, part, work.parts.count) if work.parts is not None else (0, rows)
        extents.append((slab * _slab_bytes(tensor) + first * cols, (stop - first) * cols))
    return extents


def _part_rows(rows: int, part: int, count: int) -> tuple[int, int]:
    """Stored rows [first, stop) of part ``part`` of ``count`` of a slab of ``rows`` rows."""
    return rows * part // count, rows * (part + 1) // count


def _slab_bytes(tensor: OutTensor) -> int:
    return nbytes_of(tensor.dtype, slab_shape(tensor)) if tensor.slabs else 0


@dataclass(frozen=True)
class _Job:
    """A target block and the source rectangle (stored rows, columns) that fills it, in the source's orientation."""

    target: torch.Tensor
    rows: tuple[int, int]
    cols: tuple[int, int]


def build_part(tensors: list[OutTensor], split: list[list[list[Piece]]], slab: int, part: int, parts: Parts,
               reader: Rows, get: Alloc, phases: list[int | None]) -> list[torch.Tensor]:
    """Part ``part`` of slab ``slab`` of each of ``tensors`` (those stored rows), built in place in buffers from
    ``get`` at ``phases``; each source's rows read in chunks, each chunk once for every tensor needing it."""
    scratch = Scratch3(get, tensors, slab, reader, split, parts.buffer)
    jobs: dict[tuple[Source, int], list[_Job]] = {}
    outs = []
    for tensor, pieces, at in zip(tensors, split, phases, strict=True):
        rows, cols = slab_shape(tensor)
        first, stop = _part_rows(rows, part, parts.count)
        out = get(tensor.dtype, (stop - first, cols), at)
        outs.append(out)
        for piece, job in _regions(tensor, pieces[slab], out, first, stop):
            jobs.setdefault((piece.source, piece.slab), []).append(job)
    for (source, index), todo in jobs.items():
        _fill(reader, source, index, todo, parts.chunk[(source, index)], scratch)
    return outs


def _regions(tensor: OutTensor, pieces: list[Piece], out: torch.Tensor, first: int,
             stop: int) -> Iterator[tuple[Piece, _Job]]:
    """What each piece of a slab puts into ``out``, stored rows [first, stop) of the slab."""
    matrix = out.t() if tensor.transposed else out  # HF orientation, where pieces are cut along tensor.dim
    cut = 1 if tensor.transposed else 0  # the axis of matrix that holds the part's rows
    offset = 0
    for piece in pieces:
        lo, hi = offset, offset + piece.length
        if cut == tensor.dim:
            lo, hi = max(lo, first), min(hi, stop)
        if lo < hi:
            target = matrix.narrow(tensor.dim, lo - (first if cut == tensor.dim else 0), hi - lo)
            along = (piece.start + lo - offset, piece.start + hi - offset)
            other = (0, target.size(1 - tensor.dim)) if cut == tensor.dim else (first, stop)
            rows, cols = (along, other) if tensor.dim == 0 else (other, along)
            yield piece, (_Job(target.t(), cols, rows) if piece.transposed else _Job(target, rows, cols))
        offset += piece.length


def _fill(reader: Rows, source: Source, slab: int, jobs: list[_Job], chunk: int, scratch: Scratch3) -> None:
    """Fill ``jobs`` from ``source`` (its ``slab``), reading the rows they need ``chunk`` rows at a time."""
    dtype, shape, _ = reader.info(source)
    whole = _whole_slab(reader, slab, chunk, shape)
    for start, stop, needed in _chunks(jobs, chunk):
        if _straight(needed, whole, dtype, shape[-1]):
            job = needed[0]
            a, b = max(start, job.rows[0]), min(stop, job.rows[1])
            _read_rows(reader, source, slab, a, b, job.target.narrow(0, a - job.rows[0], b - a))
            continue
        if whole:  # the reader reads whole slabs only
            rows = reader.read_rows(source, slab, slab + 1, out=scratch.rows(dtype, (1, *shape[1:])))[0, start:stop]
        else:
            rows = _read_rows(reader, source, slab, start, stop, scratch.rows(dtype, (stop - start, shape[-1])))
        flipped = _flipped(rows, needed, scratch)
        for job in needed:
            a, b = max(start, job.rows[0]), min(stop, job.rows[1])
            target = job.target.narrow(0, a - job.rows[0], b - a)
            if flipped is not None and target.stride(-1) != 1:  # rows of the chunk transposed once for all
                target.t().copy_(flipped[job.cols[0]:job.cols[1], a - start:b - start])
            else:
                copy_compact(target, rows[a - start:b - start, job.cols[0]:job.cols[1]], scratch)


def _whole_slab(reader: Rows, slab: int, chunk: int, shape: tuple[int, ...]) -> bool:
    """Whether :func:`_fill` reads a stacked source's matrix whole (the reader reads whole slabs only)."""
    return slab >= 0 and chunk == shape[-2] and not hasattr(reader, "read_slab_rows")


def _chunks(jobs: list[_Job], chunk: int) -> Iterator[tuple[int, int, list[_Job]]]:
    """The source's stored rows [start, stop) :func:`_fill` reads at a time for ``jobs``, and the jobs that take
    some of them."""
    lo, hi = min(job.rows[0] for job in jobs), max(job.rows[1] for job in jobs)
    for start in range(lo, hi, chunk):
        stop = min(start + chunk, hi)
        needed = [job for job in jobs if job.rows[0] < stop and start < job.rows[1]]
        if needed:
            yield start, stop, needed


def _straight(needed: list[_Job], whole: bool, dtype: torch.dtype, width: int) -> bool:
    """Whether a chunk's rows go straight into place: one job taking whole rows (:func:`_whole_rows`)."""
    return len(needed) == 1 and not whole and _whole_rows(needed[0], dtype, width)


def _source_scratch(reader: Rows, source: Source, slab: int, jobs: list[_Job], chunk: int) -> ScratchSizes:
    """What :func:`_fill` takes in scratch to fill ``jobs`` (meta views will do) from ``source``: each chunk read,
    its transpose where :func:`_flips` says, and what :func:`copy_compact` takes for each other job's block
    (:func:`copy_scratch`); the most of each over the chunks (those alike counted once)."""
    dtype, shape, _ = reader.info(source)
    whole = _whole_slab(reader, slab, chunk, shape)
    most: ScratchSizes = (0, 0, 0)
    seen = set()
    for start, stop, needed in _chunks(jobs, chunk):
        spans = [(max(start, job.rows[0]), min(stop, job.rows[1])) for job in needed]
        alike = (stop - start, tuple((id(job), a - start, b - start) for job, (a, b) in zip(needed, spans, strict=True)))
        if _straight(needed, whole, dtype, shape[-1]) or alike in seen:
            continue
        seen.add(alike)
        rows = torch.empty((stop - start, shape[-1]), dtype=dtype, device="meta")
        flips = _flips(rows, needed)
        sizes = [nbytes_of(dtype, shape[1:] if whole else rows.shape), nbytes_of(dtype, rows.shape) if flips else 0, 0]
        for job, (a, b) in zip(needed, spans, strict=True):
            target = job.target.narrow(0, a - job.rows[0], b - a)
            if not (flips and target.stride(-1) != 1):
                block = copy_scratch(target, rows[a - start:b - start, job.cols[0]:job.cols[1]])
                sizes = [sizes[0], max(sizes[1], block[0]), max(sizes[2], block[1])]
        most = tuple(map(max, most, sizes))  # type: ignore[assignment]
    return most


def _whole_rows(job: _Job, dtype: torch.dtype, width: int) -> bool:
    """Whether ``job`` takes whole stored rows of its source into contiguous rows of its dtype (every tp rank's NxD
    ``down_proj`` slab into a wider tp rank's): those rows are read straight into place."""
    return job.cols == (0, width) and job.target.is_contiguous() and job.target.dtype == dtype


def _read_rows(reader: Rows, source: Source, slab: int, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Stored rows [start, stop) of ``source`` (of its matrix ``slab`` of a stack, when ``slab`` >= 0) into ``out``."""
    if slab >= 0:
        return reader.read_slab_rows(source, slab, start, stop, out=out)  # type: ignore[attr-defined,no-any-return]
    return reader.read_rows(source, start, stop, out=out)


def _flipped(rows: torch.Tensor, jobs: list[_Job], scratch: Scratch3) -> torch.Tensor | None:
    """The chunk ``rows`` transposed (compact), when the jobs that take it transposed use all of its columns: every
    tp rank's columns of an expert's ``down_proj``. One blocked transpose of the chunk, then a row copy per job,
    instead of compacting each job's columns, transposing them and copying the result into place. None where the
    native kernel takes the dtype: it transposes each job's columns straight into place (``copy_compact``), one
    pass over the bytes where this is two."""
    if not _flips(rows, jobs):
        return None
    return transpose_into(scratch.source(rows.dtype, (rows.size(1), rows.size(0))), rows)


def _flips(rows: torch.Tensor, jobs: list[_Job]) -> bool:
    """Whether :func:`_flipped` transposes the chunk ``rows`` for ``jobs``."""
    flipping = [job for job in jobs if job.target.stride(-1) != 1]
    return bool(flipping) and not native_dtype(rows.dtype) and sum(j.cols[1] - j.cols[0] for j in flipping) >= rows.size(1)

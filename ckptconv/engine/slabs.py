"""Stacked tensors (NxD's experts ``[E, in, out]``) built, and read, one slab (expert) at a time.

A stacked output tensor's pieces fall into slabs (:class:`ckptconv.core.plan.OutTensor`); a piece with a ``slab``
or ``transposed`` view reads one expert of a stacked source in HF orientation. Used by the executor
(:mod:`ckptconv.engine.execute`) for every tensor whose ``by_slab`` is set.

The stacked tensors that read the same source matrices (every tp rank's ``down_proj`` reads columns of each
expert's whole HF ``down_proj``) form one group, built one slab index at a time: each source matrix is read once
per band and feeds every tensor of the group. Every buffer a band uses (its outputs, the source matrices, scratch
matrices for transposing, the chunk of rows a slab that gathers reads and, where torch transposes it, its
transpose) comes from the ``get`` allocator and is counted by :func:`slab_band_bytes`, so the executor's
``--max-memory`` accounting covers it. Scratch is small and reused, so that a band touches little fresh memory
beyond its outputs: a worker's arena is faulted in page by page on its first band, which costs about half as much
CPU again as the copy that touches it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from ckptconv.core.plan import OutTensor, Piece, Source
from ckptconv.io.transpose import native_dtype, native_takes, native_transpose, transpose_into, whole_tiles

ALIGN = 64  # what an arena's carving may add per buffer (ckptconv.engine.arena.Scratch.ALIGN)
GATHER_CHUNK = 2 << 20  # bytes of stored rows _read_transposed reads, and transposes, at a time (cache-warm)
WHOLE_GATHER = 16 << 20  # a gathered slab up to this size is read whole: its buffer stays warm from band to band
ScratchSizes = tuple[int, int, int]  # bytes of a band's scratch matrices (Scratch3): rows read, a compacted source, a target
PAGE = 4096  # what placing an output at its file offset's page phase may add (ckptconv.engine.arena.Scratch.get)


class Alloc(Protocol):
    """A buffer allocator; ``phase``: the address modulo a page the buffer should start at (an output written
    with O_DIRECT from where it was built, not copied to an aligned buffer first), or None."""

    def __call__(self, dtype: torch.dtype, shape: tuple[int, ...], phase: int | None = None) -> torch.Tensor: ...


class Rows(Protocol):
    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]: ...

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


def _empty(dtype: torch.dtype, shape: tuple[int, ...], phase: int | None = None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def slab_band(tensor: OutTensor, start: int, stop: int, reader: Rows) -> torch.Tensor:
    """Slabs [start, stop) of a stacked tensor (the whole tensor when it has no slabs), in fresh memory (a training
    rank reads its own shard this way; the executor uses :func:`build_slabs` in its arena)."""
    if not tensor.slabs:
        return build_slabs([tensor], 0, reader, _empty)[0]
    split = [slab_pieces(tensor)]
    return torch.stack([build_slabs([tensor], k, reader, _empty, split)[0] for k in range(start, stop)])


def slab_groups(tensors: Iterable[tuple[int, OutTensor]]) -> list[list[tuple[int, OutTensor]]]:
    """Tensors (``(file index, tensor)``) of the same number of slabs grouped when they read a source matrix in
    common (union-find over the matrices read whole), so that a band reads it once for all of them: every tp rank's
    ``down_proj`` of an expert (to-nxd), or an expert's HF gate and up from the same NxD ``gate_up_proj`` slabs."""
    items = list(tensors)
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_reader: dict[tuple[int, Source, int], int] = {}
    for i, (_, tensor) in enumerate(items):
        for piece in tensor.pieces:
            if _shared(piece, tensor.dim):
                j = first_reader.setdefault((tensor.slabs, piece.source, piece.slab), i)
                parent[find(i)] = find(j)
    groups: dict[int, list[tuple[int, OutTensor]]] = {}
    for i, item in enumerate(items):
        groups.setdefault(find(i), []).append(item)
    return list(groups.values())


@dataclass(frozen=True)
class SlabBands:
    """A group's pieces split by slab once (``pieces[t][k]``: slab ``k`` of tensor ``t``), the bytes of each slab
    index's three scratch matrices (:func:`_scratch_bytes`), the most bytes a band takes (:func:`slab_band_bytes`),
    and the most of those that are source matrices read whole."""

    pieces: list[list[list[Piece]]]
    scratch: list[ScratchSizes]
    nbytes: int
    sources: int = 0


def slab_bands(tensors: list[OutTensor], reader: Rows) -> SlabBands:
    """``tensors``' pieces split by slab, and what one slab index of them takes from :func:`build_slabs`'s
    allocator, at most (the band budget) and in scratch, per index."""
    split = [slab_pieces(tensor) for tensor in tensors]
    most, whole, scratch = 0, 0, []
    memo: dict[tuple[object, ...], ScratchSizes] = {}
    for k in range(max(tensors[0].slabs, 1)):
        scratch.append(_scratch_bytes(tensors, k, reader, split, memo))
        nbytes = scratch_nbytes(scratch[k]) + _gather_bytes(tensors, k, reader, split) + ALIGN
        sources: dict[tuple[Source, int], int] = {}
        for tensor, pieces in zip(tensors, split, strict=True):
            nbytes += nbytes_of(tensor.dtype, slab_shape(tensor)) + PAGE
            if _gathers(tensor, pieces[k], reader):  # its sources' rows go through the gather chunks
                continue
            for piece in pieces[k]:
                if _shared(piece, tensor.dim) and (piece.source, piece.slab) not in sources:
                    dtype, shape, _ = reader.info(piece.source)
                    sources[(piece.source, piece.slab)] = nbytes_of(dtype, shape[1:] if piece.slab >= 0 else shape)
        nbytes += sum(size + ALIGN for size in sources.values())
        most, whole = max(most, nbytes), max(whole, sum(sources.values()))
    return SlabBands(split, scratch, most, whole)


def slab_band_bytes(tensors: list[OutTensor], reader: Rows) -> int:
    """The most bytes :func:`build_slabs` takes from its allocator for one slab index of ``tensors``."""
    return slab_bands(tensors, reader).nbytes


def scratch_nbytes(sizes: ScratchSizes) -> int:
    """What a band's scratch matrices of ``sizes`` take from its allocator (each carved at most once, aligned)."""
    return sum(size + ALIGN for size in sizes if size)


def _scratch_bytes(tensors: list[OutTensor], k: int, reader: Rows, split: list[list[list[Piece]]],
                   memo: dict[tuple[object, ...], ScratchSizes] | None = None) -> ScratchSizes:
    """The most bytes of each scratch matrix any piece of slab ``k`` of ``tensors`` (split by slab in ``split``)
    uses in :func:`build_slabs` (:func:`_piece_scratch`); ``memo``: pieces' needs by layout, across slab indices
    (an expert's pieces are laid out as every other's)."""
    memo = {} if memo is None else memo
    most = (0, 0, 0)
    for tensor, pieces in zip(tensors, split, strict=True):
        if _gathers(tensor, pieces[k], reader):
            continue
        for piece in pieces[k]:
            dtype, shape, _ = reader.info(piece.source)
            layout = (slab_shape(tensor), tensor.dtype, tensor.transposed, tensor.dim, piece.start, piece.length,
                      piece.transposed, piece.slab >= 0, piece.viewed, piece.zeros, bool(piece.alternates),
                      bool(piece.row_perm), dtype, shape)
            if layout not in memo:
                memo[layout] = _piece_scratch(tensor, piece, reader)
            most = tuple(map(max, most, memo[layout]))  # type: ignore[assignment]
    return most


def _piece_scratch(tensor: OutTensor, piece: Piece, reader: Rows) -> ScratchSizes:
    """The scratch matrices :func:`build_slabs` uses for ``piece`` of a slab of ``tensor``: its route
    (:func:`_route`) and :func:`copy_scratch` on shape-only (meta) views of the matrices it would copy."""
    dtype, shape, _ = reader.info(piece.source)
    out = torch.empty(slab_shape(tensor), dtype=tensor.dtype, device="meta")
    target = (out.t() if tensor.transposed else out).narrow(tensor.dim, 0, piece.length)
    route = _route(tensor, piece, reader, target, dtype)
    if route in ("slab", "read"):
        return 0, 0, 0
    if route == "shared":
        matrix = torch.empty(shape[1:] if piece.slab >= 0 else shape, dtype=dtype, device="meta")
        return (0, *copy_scratch(target, _cut(matrix, piece, tensor.dim)))
    rows = torch.empty(tuple(target.shape), dtype=dtype, device="meta")
    return (nbytes_of(dtype, rows.shape), *copy_scratch(target, rows))


def _route(tensor: OutTensor, piece: Piece, reader: Rows, target: torch.Tensor, dtype: torch.dtype) -> str:
    """How :func:`build_slabs` fills ``target`` (``piece``'s block of a slab, in HF orientation) from ``piece``'s
    stored ``dtype``: ``slab`` (rows of one matrix of a stack) or ``read`` (rows of a matrix) straight into place,
    ``shared`` cut from its source matrix read whole, or ``rows`` read into scratch and copied."""
    stored = target.t() if tensor.transposed else target
    if _rows_of_slab(piece, tensor, reader) and stored.is_contiguous() and dtype == tensor.dtype:
        return "slab"
    if _shared(piece, tensor.dim):
        return "shared"
    return "read" if target.is_contiguous() and dtype == tensor.dtype else "rows"


def build_slabs(tensors: list[OutTensor], k: int, reader: Rows, get: Alloc,
                split: list[list[list[Piece]]] | None = None, scratch_bytes: ScratchSizes | None = None,
                phases: list[int | None] | None = None) -> list[torch.Tensor]:
    """Slab ``k`` of each of ``tensors`` (the whole tensor when unstacked), in its stored orientation and dtype, built
    in place in buffers from ``get`` (each output at its ``phases`` entry); each source matrix read whole is read once
    for all of them. ``split``: the tensors' pieces split by slab (:func:`slab_pieces`), ``scratch_bytes``: slab
    ``k``'s scratch size (:class:`SlabBands`), when already known."""
    if split is None:
        split = [slab_pieces(tensor) for tensor in tensors]
    cache: dict[tuple[Source, int], torch.Tensor] = {}
    scratch = Scratch3(get, tensors, k, reader, split, scratch_bytes)
    gather: torch.Tensor | None = None
    outs = []
    for n, (tensor, pieces) in enumerate(zip(tensors, split, strict=True)):
        out = get(tensor.dtype, slab_shape(tensor), phases[n] if phases else None)
        outs.append(out)
        if _gathers(tensor, pieces[k], reader):
            if gather is None:
                gather = get(torch.uint8, (_gather_bytes(tensors, k, reader, split),))
            _read_transposed(reader, pieces[k], out, gather, _chunk_rows(tensor))
            continue
        matrix = out.t() if tensor.transposed else out  # in HF orientation, where the pieces are cut
        offset = 0
        for piece in pieces[k]:
            target = matrix.narrow(tensor.dim, offset, piece.length)
            dtype = reader.info(piece.source)[0]
            route = _route(tensor, piece, reader, target, dtype)
            if route == "slab":
                _read_piece(reader, piece, target.t() if tensor.transposed else target)
            elif route == "read":  # rows of a matrix straight into place
                _read_piece(reader, piece, target)
            elif route == "shared":
                copy_compact(target, _viewed(reader, piece, tensor.dim, cache, get), scratch)
            else:
                rows = reader.read_rows(piece.source, piece.start, piece.stop,
                                        out=scratch.rows(dtype, tuple(target.shape)))
                copy_compact(target, rows, scratch)
            offset += piece.length
    return outs


def _gathers(tensor: OutTensor, pieces: list[Piece], reader: Rows) -> bool:
    """Whether a slab of ``tensor`` (its ``pieces``) is the transpose of a stack of stored rows of its sources, in
    its dtype, each piece readable a few rows at a time (or, for a slab read at once, a whole matrix of a stack):
    NxD's ``gate_up_proj`` from an expert's HF gate and up rows (to-nxd), an HF ``down_proj`` from every tp rank's NxD
    slab (to-hf). Those rows are then read and transposed a chunk at a time (:func:`_read_transposed`), not
    transposed piece by piece into part of each row."""
    if tensor.dim != (0 if tensor.transposed else 1) or not pieces or len(slab_shape(tensor)) != 2:
        return False
    whole = _chunk_rows(tensor) == slab_shape(tensor)[1]  # read at once: a whole matrix of a stack needs no row reads
    for piece in pieces:
        dtype, shape, column_major = reader.info(piece.source)
        if (piece.zeros or piece.alternates or piece.row_perm or piece.transposed == tensor.transposed
                or column_major or dtype != tensor.dtype or (piece.slab >= 0 and not hasattr(reader, "read_slab_rows")
                                                             and not (whole and piece.length == shape[1]))):
            return False
    return True


def _chunk_rows(tensor: OutTensor) -> int:
    """Stored rows of a gathering ``tensor``'s sources :func:`_read_transposed` takes at a time (all of them: the
    slab's columns): the whole slab up to WHOLE_GATHER bytes, else about GATHER_CHUNK bytes in whole tiles of the
    native kernel, at least 64 (torch's transpose works in 60 x 60 blocks)."""
    rows, cols = slab_shape(tensor)
    if nbytes_of(tensor.dtype, (rows, cols)) <= WHOLE_GATHER:
        return cols
    return max(1, min(cols, whole_tiles(max(64, GATHER_CHUNK // max(1, rows * tensor.dtype.itemsize)))))


def _gather_bytes(tensors: list[OutTensor], k: int, reader: Rows, split: list[list[list[Piece]]]) -> int:
    """The matrices :func:`_read_transposed` uses for slab ``k`` (the rows read; for a slab in chunks that the native
    kernel does not transpose into place, also their transpose): the most any tensor of the group that gathers
    needs, or 0."""
    def need(tensor: OutTensor) -> int:
        rows = _chunk_rows(tensor)
        size = nbytes_of(tensor.dtype, (rows, slab_shape(tensor)[0]))
        return size if rows == slab_shape(tensor)[1] or native_dtype(tensor.dtype) else 2 * size

    return max((need(t) for t, pieces in zip(tensors, split, strict=True) if _gathers(t, pieces[k], reader)), default=0)


def _read_transposed(reader: Rows, pieces: list[Piece], out: torch.Tensor, gather: torch.Tensor, rows: int) -> None:
    """``out``'s transpose read ``rows`` stored rows at a time into ``gather``, and transposed into ``out``
    (``ckptconv.io.transpose``): all of them at once, or each chunk straight into its columns of ``out`` (the native
    kernel), else into a second matrix of ``gather`` and copied into those columns (torch's transpose is fast only
    into a contiguous matrix from the transpose of a contiguous one). Chunks keep both matrices in
    cache and the fresh memory a band touches to its output: read whole into a matrix of its own, a large slab's
    page faults in that matrix cost more CPU than the extra copy (to-nxd of Mixtral's ``gate_up_proj``, measured);
    a small slab's buffer stays warm in the worker's arena, and the one copy is cheaper."""
    width = out.size(0) * out.element_size()
    total = out.size(1)
    for lo in range(0, total, rows):
        n = min(rows, total - lo)
        read = gather[:n * width].view(out.dtype).view(n, out.size(0))
        offset = 0
        for piece in pieces:  # the pieces' rows [lo, lo + n) of the stack
            a, b = max(lo, offset), min(lo + n, offset + piece.length)
            if a < b:
                _read_piece(reader, piece, read[a - lo:b - lo], a - offset)
            offset += piece.length
        if n == total or native_dtype(out.dtype):  # the kernel writes into the columns as they are
            transpose_into(out[:, lo:lo + n], read)
        else:
            flip = gather[rows * width:(rows + n) * width].view(out.dtype).view(out.size(0), n)
            out[:, lo:lo + n].copy_(transpose_into(flip, read))


def _rows_of_slab(piece: Piece, tensor: OutTensor, reader: Rows) -> bool:
    """Whether ``piece`` is stored rows of one matrix of a stack that :func:`_read_piece` reads alone, landing in
    stored rows of ``tensor``: TorchTitan's ``w1[e]`` into an HF expert's ``gate_proj`` (from-dcp), every tp rank's
    NxD ``down_proj`` slab into a wider tp rank's (reshard); read straight into place, not read whole and copied."""
    return (piece.slab >= 0 and piece.transposed == tensor.transposed and tensor.dim == int(tensor.transposed)
            and (piece.length == reader.info(piece.source)[1][1] or hasattr(reader, "read_slab_rows")))


def _read_piece(reader: Rows, piece: Piece, out: torch.Tensor, lo: int = 0) -> None:
    """The stored rows ``piece`` reads (rows of a matrix, or of one matrix of a stack) into ``out``; from its row
    ``lo`` on, as many as ``out`` holds."""
    start, stop = piece.start + lo, piece.start + lo + out.size(0)
    if piece.slab >= 0 and stop - start == reader.info(piece.source)[1][1]:  # a whole matrix of a stack
        reader.read_rows(piece.source, piece.slab, piece.slab + 1, out=out.unsqueeze(0))
    elif piece.slab >= 0:
        reader.read_slab_rows(piece.source, piece.slab, start, stop, out=out)  # type: ignore[attr-defined]
    else:
        reader.read_rows(piece.source, start, stop, out=out)


class Scratch3:
    """Three reusable matrices of a band (rows read, a compacted source, a target), for transposes that need
    compact operands; each sized by its entry of ``sizes`` (:func:`_scratch_bytes`, or the parts' chunks) and carved
    on first use: a band whose pieces need only some of them carves only those. A request past its matrix's size
    (the budget's rule and the build disagree) takes a buffer of its own from the allocator, which counts it as an
    overflow, rather than failing."""

    def __init__(self, get: Alloc, tensors: list[OutTensor], k: int, reader: Rows, split: list[list[list[Piece]]],
                 sizes: ScratchSizes | None) -> None:
        self.get, self.tensors, self.k, self.reader, self.split = get, tensors, k, reader, split
        self.sizes = sizes
        self.buffers: list[torch.Tensor | None] = [None, None, None]

    def _buffer(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self.sizes is None:
            self.sizes = _scratch_bytes(self.tensors, self.k, self.reader, self.split)
        nbytes = nbytes_of(dtype, shape)
        if nbytes > self.sizes[index]:
            return self.get(dtype, shape)
        buffer = self.buffers[index]
        if buffer is None:
            buffer = self.buffers[index] = self.get(torch.uint8, (self.sizes[index],))
        return buffer[:nbytes].view(dtype).view(shape)

    def rows(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._buffer(0, dtype, shape)

    def source(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._buffer(1, dtype, shape)

    def target(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._buffer(2, dtype, shape)


def copy_compact(target: torch.Tensor, src: torch.Tensor, scratch: Scratch3) -> None:
    """``target.copy_(src)`` for matrices either of which may be a transposed view. The native kernel
    (``ckptconv.io.transpose``) takes rows of unit stride any distance apart as they are; torch transposes fast (in
    cache-sized blocks) only into a contiguous matrix from the transpose of a contiguous one of the same dtype, a
    strided transpose ~8x slower (bf16, measured): for it the operands are made compact in scratch first
    (:func:`_compactions`, which :func:`copy_scratch` budgets)."""
    target, src = _rows_first(target, src)
    if _plain(src):
        target.copy_(src)
        return
    if native_transpose(target, src.t()):  # the native kernel takes strided rows as they are
        return
    compact_source, compact_target = _compactions(target, src)
    if compact_source:
        src = scratch.source(target.dtype, (src.size(1), src.size(0))).copy_(src.t()).t()
    if compact_target:
        target.copy_(transpose_into(scratch.target(target.dtype, tuple(target.shape)), src.t()))
    else:
        transpose_into(target, src.t())


def copy_scratch(target: torch.Tensor, src: torch.Tensor) -> tuple[int, int]:
    """The bytes of the source and target scratch matrices :func:`copy_compact` uses to copy ``src`` into
    ``target`` (views of their layout will do: meta tensors): none for a plain copy or the native kernel's transpose
    (where it takes the pair: the same test :func:`native_transpose` makes), else what :func:`_compactions` says
    torch's transpose needs."""
    target, src = _rows_first(target, src)
    if _plain(src) or native_takes(target, src.t()):
        return 0, 0
    size = nbytes_of(target.dtype, target.shape)
    return tuple(size if need else 0 for need in _compactions(target, src))  # type: ignore[return-value]


def _rows_first(target: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair as :func:`copy_compact` copies it: a transposed target as the copy of the transposes."""
    return (target.t(), src.t()) if target.stride(-1) != 1 else (target, src)


def _plain(src: torch.Tensor) -> bool:
    """Whether ``src`` (of a pair from :func:`_rows_first`) has rows of unit stride too: no transpose, a copy."""
    return src.stride(-1) == 1 or src.numel() <= 1


def _compactions(target: torch.Tensor, src: torch.Tensor) -> tuple[bool, bool]:
    """Which operands torch's transpose of ``src`` into ``target`` (a pair from :func:`_rows_first`) makes compact
    in scratch first: the source's transpose where it is not a contiguous matrix of the target's dtype, the target
    where it is not contiguous."""
    return src.stride(1) != src.size(0) or src.dtype != target.dtype, not target.is_contiguous()


def _shared(piece: Piece, dim: int) -> bool:
    """Whether the piece is cut from a source matrix read whole (not rows read straight)."""
    if piece.zeros or piece.alternates or piece.row_perm:
        raise AssertionError(f"{piece.source.key}: padded, averaged or permuted pieces have no slab view")
    return piece.viewed or dim != 0


def slab_shape(tensor: OutTensor) -> tuple[int, ...]:
    return tensor.shape[1:] if tensor.slabs else tensor.shape


def slab_pieces(tensor: OutTensor) -> list[list[Piece]]:
    """The tensor's pieces split by slab, in one pass (a slab's pieces lie within it, in order): ``[k]`` those of
    slab ``k``; an unstacked tensor is one slab of all its pieces."""
    if not tensor.slabs:
        return [list(tensor.pieces)]
    per = sum(p.length for p in tensor.pieces) // tensor.slabs
    split: list[list[Piece]] = [[] for _ in range(tensor.slabs)]
    offset = 0
    for piece in tensor.pieces:
        if offset // per < tensor.slabs:
            split[offset // per].append(piece)
        offset += piece.length
    return split


def nbytes_of(dtype: torch.dtype, shape: Iterable[int]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def _viewed(reader: Rows, piece: Piece, dim: int, cache: dict[tuple[Source, int], torch.Tensor],
            get: Alloc) -> torch.Tensor:
    """``piece`` as a matrix in HF orientation: its slab, transposed if so, cut along ``dim`` (the matrix read once)."""
    if (piece.source, piece.slab) not in cache:
        dtype, shape, _ = reader.info(piece.source)
        if piece.slab >= 0:
            buffer = get(dtype, (1, *shape[1:]))
            cache[(piece.source, piece.slab)] = reader.read_rows(piece.source, piece.slab, piece.slab + 1,
                                                                 out=buffer)[0]
        else:
            cache[(piece.source, piece.slab)] = reader.read_rows(piece.source, 0, shape[0], out=get(dtype, shape))
    return _cut(cache[(piece.source, piece.slab)], piece, dim)


def _cut(matrix: torch.Tensor, piece: Piece, dim: int) -> torch.Tensor:
    """``piece``'s block of its source ``matrix`` (a slab of a stack, or a whole matrix), in HF orientation."""
    return (matrix.t() if piece.transposed else matrix).narrow(dim, piece.start, piece.length)

"""Stacked tensors (NxD's experts ``[E, in, out]``) built, and read, one slab (expert) at a time.

A stacked output tensor's pieces fall into slabs (:class:`ckptconv.core.plan.OutTensor`); a piece with a ``slab``
or ``transposed`` view reads one expert of a stacked source in HF orientation. Used by the executor
(:mod:`ckptconv.engine.execute`) for every tensor whose ``by_slab`` is set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ckptconv.core.plan import OutTensor, Piece, Source


class Rows(Protocol):
    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]: ...

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


def slab_band(tensor: OutTensor, start: int, stop: int, reader: Rows) -> torch.Tensor:
    """Slabs [start, stop) of a stacked tensor (the whole tensor when it has no slabs)."""
    cache: dict[tuple[Source, int], torch.Tensor] = {}
    if not tensor.slabs:
        return slab_matrix(tensor, tensor.pieces, reader, cache)
    per = sum(p.length for p in tensor.pieces) // tensor.slabs
    groups: list[list[Piece]] = [[] for _ in range(tensor.slabs)]
    offset = 0
    for piece in tensor.pieces:
        groups[offset // per].append(piece)
        offset += piece.length
    return torch.stack([slab_matrix(tensor, groups[k], reader, cache) for k in range(start, stop)])


def slab_matrix(tensor: OutTensor, pieces: Iterable[Piece], reader: Rows,
                 cache: dict[tuple[Source, int], torch.Tensor]) -> torch.Tensor:
    parts = [viewed_piece(reader, p, tensor.dim, cache) for p in pieces]
    matrix = torch.cat([p.to(parts[0].dtype) for p in parts], dim=tensor.dim) if len(parts) > 1 else parts[0]
    return (matrix.t() if tensor.transposed else matrix).contiguous()


def viewed_piece(reader: Rows, piece: Piece, dim: int,
                  cache: dict[tuple[Source, int], torch.Tensor]) -> torch.Tensor:
    """``piece`` as a matrix in the reading tensor's orientation: its slab, transposed if so, cut along ``dim``."""
    if piece.zeros or piece.alternates or piece.row_perm:
        raise AssertionError(f"{piece.source.key}: padded, averaged or permuted pieces have no slab view")
    if not piece.viewed and dim == 0:
        return reader.read_rows(piece.source, piece.start, piece.stop)
    if (piece.source, piece.slab) not in cache:
        shape = reader.info(piece.source)[1]
        whole = (piece.slab, piece.slab + 1) if piece.slab >= 0 else (0, shape[0])
        matrix = reader.read_rows(piece.source, *whole)
        cache[(piece.source, piece.slab)] = matrix[0] if piece.slab >= 0 else matrix
    matrix = cache[(piece.source, piece.slab)]
    return (matrix.t() if piece.transposed else matrix).narrow(dim, piece.start, piece.length)

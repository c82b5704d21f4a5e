"""Which bytes of its output file a band is about to write, announced to the file's digest when the band starts;
and the order of the units, so that each file's bands start in file order.

An output file is hashed as it is written, in file order (ckptconv.io.write_digest); a band that finishes
before the band just ahead of it in the same file then waits for that one instead of leaving its own bytes to
be read back. A band that writes several extents (an expert's HF w1 and w3, one tensor for each of several files)
claims them all, writes them front to back in one order shared by every band (by file index, then file offset:
:func:`write_order`) and gives each claim up once its extent is written. So every wait ends: a band waits only
while writing its earliest unwritten extent, for the claim at the hashed prefix before it; the band holding that
claim has an unwritten extent there, earlier than the one it writes if it waits too, so along a chain of waits the
extents written strictly precede one another and the chain ends at a band writing at the hashed prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckptconv.core.plan import OutTensor, Plan, Source


def band_extent(tensor: OutTensor, start: int, stop: int, transposed: bool = False) -> tuple[int, int]:
    """(byte offset in the tensor's stored bytes, byte length) that rows [start, stop) of ``tensor`` occupy, as the
    executor writes them; ``transposed``: rows of a column-major tensor's storage (its columns), else a
    column-major or 0-dim tensor is written whole, in one band."""
    itemsize = tensor.dtype.itemsize
    if transposed:
        return start * tensor.shape[0] * itemsize, (stop - start) * tensor.shape[0] * itemsize
    if tensor.column_major or not tensor.shape:
        return 0, row_bytes(tensor.shape, itemsize) * (tensor.shape[0] if tensor.shape else 1)
    row = row_bytes(tensor.shape, itemsize)
    return start * row, (stop - start) * row


def row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (dim 0) of a tensor of ``shape``: the unit bands are cut in."""
    numel = 1
    for size in shape[1:]:
        numel *= size
    return numel * itemsize


class BandClaims:
    """The claims of one band (:func:`claim_band`): :meth:`written` as each tensor's extent is written whole,
    :meth:`release` when the band ends (written or not)."""

    def __init__(self, releases: list[Callable[[], None] | None]) -> None:
        self._releases = releases  # per tensor of the band: the claim its last byte gives up, or None

    def written(self, n: int) -> None:
        """Tensor ``n``'s extent is written: give its claim up."""
        release, self._releases[n] = self._releases[n], None
        if release is not None:
            release()

    def release(self) -> None:
        for n in range(len(self._releases)):
            self.written(n)


def claim_band(tensors: list[tuple[int, OutTensor]], spans: list[tuple[int, int]],
               sinks: Mapping[int, Any]) -> BandClaims:
    """Claim the extents ``spans`` (byte offset in its tensor, bytes) a band will write of each of ``tensors`` (see
    the module); extents that lie back to back in one file in the order given (an expert's HF gate and up) are one
    claim, given up with the last."""
    one = _back_to_back(tensors, spans, sinks)
    releases: list[Callable[[], None] | None] = [None] * len(tensors)
    try:
        for n, (file_index, tensor) in enumerate(tensors if one is None else tensors[:1]):
            claim = getattr(sinks[file_index], "claim", None)
            if claim is not None:
                releases[n if one is None else -1] = claim(tensor.key, *(spans[n] if one is None else one))
    except BaseException:  # a claim left standing would keep the writers behind it waiting
        for each in releases:
            if each is not None:
                each()
        raise
    return BandClaims(releases)


def write_order(tensors: list[tuple[int, OutTensor]], extents: list[tuple[int, int]],
                place: Callable[[int, OutTensor], int]) -> list[int]:
    """Indices of a band's ``tensors`` in the order to write them: by file, then where each of ``extents`` (byte
    offset in its tensor, bytes) lies in it (``place``: where the tensor starts; for a sink of several physical
    files, xser's, where it starts in its own file: the order of the extents of each physical file is kept). Every
    band writes in this order: the module's argument that every wait ends rests on it."""
    return sorted(range(len(tensors)),
                  key=lambda n: (tensors[n][0], place(*tensors[n]) + extents[n][0], n))


def _back_to_back(tensors: list[tuple[int, OutTensor]], spans: list[tuple[int, int]],
                  sinks: Mapping[int, Any]) -> tuple[int, int] | None:
    """The extents ``spans`` of ``tensors`` as one extent of the first tensor (byte offset, bytes), where there are
    several and all lie back to back in one file (the sink's ``file_offset``) in the order given; else None."""
    if len(tensors) < 2 or len({i for i, _ in tensors}) != 1:
        return None
    place = getattr(sinks[tensors[0][0]], "file_offset", None)
    if place is None:
        return None
    end = None
    for (_, tensor), (offset, nbytes) in zip(tensors, spans, strict=True):
        at = place(tensor.key, offset)
        if end is not None and at != end:
            return None
        end = at + nbytes
    return spans[0][0], sum(nbytes for _, nbytes in spans)


def unit_order(units: list[list[tuple[int, OutTensor]]], plan: Plan,
               position: Callable[[Source], int] | None,
               place: Callable[[int, OutTensor], int]) -> list[int]:
    """Indices of ``units`` (each its (file index, tensor) list) in the order to run them; ``place``: where a
    tensor's bytes start in its file (a safetensors file orders its tensors by dtype and name, not as planned;
    ties, e.g. a sink that cannot say, go by the tensor's index in the plan's file).

    Files that units cut by columns write together (the tp ranks of one source) form a group; groups run one
    after another, earliest file first, so files complete (and are recorded) while the rest converts. Within a
    group, by the position of the unit's tensor in its file, so every file of the group is written front to back
    at once and its digest hashes the bands as they arrive; ties in the order their sources lie in their files
    (checked reads then hash what the workers read as it comes). Where sources have positions, the files that read
    slabs of one stacked source (two target ep ranks' experts from one source ep rank) form a group too, run in the
    order of the bytes they read: source files are then read front to back, not hashed out of order."""
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    def join(i: int, j: int) -> bool:
        a, b = find(i), find(j)
        parent[max(a, b)] = min(a, b)
        return a != b

    for tensors in units:
        for i, _ in tensors[1:]:
            join(tensors[0][0], i)
    by_source = set()
    if position is not None:
        reader_of: dict[Source, int] = {}
        for tensors in units:
            for i, tensor in tensors:
                for piece in tensor.pieces if tensor.by_slab else ():
                    if piece.slab >= 0 and join(reader_of.setdefault(piece.source, i), i):
                        by_source.add(i)
        by_source = {find(i) for i in by_source}
    files = {i for tensors in units for i, _ in tensors}
    index = {(i, t.key): (place(i, t), n) for i in files for n, t in enumerate(plan.files[i].tensors)}

    def key(n: int) -> tuple[int, ...]:
        file_index, (byte, at) = min((i, index[(i, t.key)]) for i, t in units[n])
        piece = plan.files[file_index].tensors[at].pieces[0]
        where = position(piece.source) if position is not None else 0
        if find(file_index) in by_source:
            return find(file_index), where, piece.slab, byte, at, file_index
        return find(file_index), byte, at, file_index, where

    return sorted(range(len(units)), key=key)

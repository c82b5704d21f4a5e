"""Which bytes of its output file a band is about to write, announced to the file's digest when the band starts.

An output file is hashed as it is written, in file order (ckptconv.io.write_digest); a band that finishes
before the band just ahead of it in the same file then waits for that one instead of leaving its own bytes to
be read back. A band that writes several extents (one tensor for each of several files) claims them all but never
waits itself, so every wait ends: the claim waited for belongs to a thread that never waits, or that writes it at
the hashed prefix (or releases it when its band ends).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckptconv.core.plan import OutTensor
from ckptconv.io.write_digest import waiting


def _nothing() -> None:
    pass


def band_extent(tensor: OutTensor, start: int, stop: int) -> tuple[int, int]:
    """(byte offset in the tensor's stored bytes, byte length) that rows [start, stop) of ``tensor`` occupy, as the
    executor writes them (a column-major or 0-dim tensor is written whole, in one band)."""
    itemsize = tensor.dtype.itemsize
    numel = 1
    for size in tensor.shape:
        numel *= size
    if tensor.column_major or not tensor.shape:
        return 0, numel * itemsize
    row = numel // tensor.shape[0] * itemsize if tensor.shape[0] else 0
    return start * row, (stop - start) * row


def claim_band(tensors: list[tuple[int, OutTensor]], start: int, stop: int,
               sinks: Mapping[int, Any]) -> Callable[[], None]:
    """Claim the extents a band will write (see the module); returns the release. A band of stacked slabs claims
    nothing; a band writing several extents claims them all and its writes never wait."""
    if tensors[0][1].by_slab:
        return _nothing
    releases = []
    for file_index, tensor in tensors:
        claim = getattr(sinks[file_index], "claim", None)
        if claim is not None:
            releases.append(claim(tensor.key, *band_extent(tensor, start, stop)))
    waiting(len(tensors) == 1)

    def release() -> None:
        for each in releases:
            each()
        waiting(True)

    return release

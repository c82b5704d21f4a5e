"""Positional file I/O shared by every format: reads through mmap or ``preadv``, complete pwrites.

Reads copy into a caller's buffer. With mmap the touched pages are released right after the copy
(``MADV_DONTNEED``) so RSS stays bounded; the page cache keeps the data. With ``io="read"`` no
mapping exists at all, which is what network file systems (Lustre/FSx, NFS) want.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ckptconv.io.direct_io import pwrite_direct, twin_of

IO_CHUNK = 64 << 20  # per-syscall cap: Linux truncates single reads/writes near 2 GiB anyway
# Buffered writes go 128 KiB a pwrite, as cp's do (64 KiB splices): one large pwrite makes the kernel fill the page
# cache with large folios, taken from the free 2 MiB blocks that a VM's balloon has handed back to the host (a host
# fault each at first touch); small folios come from the pages freed last. A 336 MB file: 0.8 s in 64 MiB pwrites,
# 0.07-0.09 s in 128 KiB ones or by cp (docs/performance.md, "Saves").
WRITE_CHUNK = 128 << 10
# A write whose bytes are also checksummed (CRC-32, BLAKE3) hands them over in pieces of this size, each right after
# its pwrites, while the piece is still in the core's cache: one pass over memory instead of three (~13% less CPU
# for a save's pwrite + CRC-32 + BLAKE3 on two threads: docs/performance.md, "One pass over each written byte").
CACHE_PIECE = 512 << 10
IO_MODES = ("mmap", "read")
# rows of a column read mapped in at a time: the pages around the columns that fault-around maps count as RSS
COLUMN_REGION = 8 << 20


class PositionalFile:
    """A file opened read-only for positional reads.

    >>> f = PositionalFile("model.safetensors", io="read")   # doctest: +SKIP
    >>> header = f.read(0, 8)                                 # doctest: +SKIP
    """

    def __init__(self, path: str, io: str, check: Any = None) -> None:
        if io not in IO_MODES:
            raise ValueError(f"{path}: io must be 'mmap' or 'read', got {io!r}")
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.mm: mmap.mmap | None = None
        # A checked-reads StreamCheck (ckptconv.io.checked) that sees every data read, or None.
        self.check = check
        if io == "mmap" and self.size:
            try:
                self.mm = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(self.fd)
                raise

    def read_into(self, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes starting at ``offset`` into ``dst`` (tensor data: the check sees them)."""
        if self.check is None:
            self.copy_into(offset, dst)
            return
        self.check.begin(offset, len(dst))
        try:
            self.copy_into(offset, dst)
        except BaseException:
            self.check.abandon(offset, len(dst))
            raise
        self.check.consumed_bytes(offset, dst, self.copy_into)

    def copy_into(self, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes starting at ``offset`` into ``dst``, unseen by the check."""
        if self.fd < 0:
            raise ValueError(f"{self.path}: file is closed")
        end = offset + len(dst)
        if offset < 0 or end > self.size:
            raise ValueError(f"{self.path}: read [{offset}, {end}) past end of file ({self.size} bytes)")
        if not len(dst):
            return
        if self.mm is not None:
            # A file truncated after open would SIGBUS through the mapping: check first.
            if os.fstat(self.fd).st_size < end:
                raise ValueError(f"{self.path}: file shrank below {end} bytes while open")
            with memoryview(self.mm) as src:
                dst[:] = src[offset:end]
            page = offset - offset % mmap.PAGESIZE
            self.mm.madvise(mmap.MADV_DONTNEED, page, end - page)
            return
        # Ask the kernel to start reading what a sequential reader wants next, so disk reads
        # overlap with our processing of this band (it is only a hint).
        os.posix_fadvise(self.fd, end, len(dst), os.POSIX_FADV_WILLNEED)
        done = 0
        while done < len(dst):  # preadv may return short counts
            got = os.preadv(self.fd, [dst[done:done + IO_CHUNK]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.path}: unexpected end of file at {offset + done}, wanted up to {end}")
            done += got

    def copy_columns_into(self, offset: int, row_bytes: int, lo: int, dst: torch.Tensor) -> bool:
        """Bytes ``[lo, lo + dst.shape[1])`` of each of ``dst.shape[0]`` rows of ``row_bytes`` from ``offset`` into
        the uint8 matrix ``dst``: through the mapping, a few MB of rows at a time, each released after its copy
        (only the pages holding those columns are read), or one ``pread`` per row. False (nothing read) when a
        check must see the reads in file order: the caller reads whole rows instead."""
        rows, width = dst.shape
        end = offset + rows * row_bytes
        if self.check is not None:
            return False
        if self.fd < 0 or offset < 0 or end > self.size or lo + width > row_bytes:
            raise ValueError(f"{self.path}: column read [{offset}, {end}) outside the file ({self.size} bytes)")
        if not dst.numel():
            return True
        target = dst.numpy()
        if self.mm is None:
            for row in range(rows):
                if os.preadv(self.fd, [target[row]], offset + row * row_bytes + lo) != width:
                    raise ValueError(f"{self.path}: unexpected end of file in row {row} of a column read at {offset}")
            return True
        if os.fstat(self.fd).st_size < end:
            raise ValueError(f"{self.path}: file shrank below {end} bytes while open")
        step = max(1, COLUMN_REGION // row_bytes)
        for row in range(0, rows, step):
            start = offset + row * row_bytes
            n = min(step, rows - row)
            region = np.frombuffer(self.mm, np.uint8, n * row_bytes, start).reshape(n, row_bytes)
            target[row:row + n] = region[:, lo:lo + width]
            del region  # the mapping can not be closed while a view of it lives
            page = start - start % mmap.PAGESIZE
            self.mm.madvise(mmap.MADV_DONTNEED, page, start + n * row_bytes - page)
        return True

    def read(self, offset: int, n: int) -> bytes:
        """File structure (headers, directories): not tensor data, so unseen by the check."""
        buf = bytearray(n)
        self.copy_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        """Release the mapping and the descriptor (idempotent)."""
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileWindow:
    """Bytes ``[offset, offset + size)`` of an open :class:`PositionalFile`, read as a file of their own
    (one torch.save blob among several in a DCP ``.distcp``). Reads go through the base file, so its
    check sees them at their real offsets; closing a window leaves the base open.
    """

    def __init__(self, base: PositionalFile, offset: int, size: int, name: str) -> None:
        if offset < 0 or size < 0 or offset + size > base.size:
            raise ValueError(f"{name}: bytes [{offset}, {offset + size}) lie outside {base.path} ({base.size} bytes)")
        self.base, self.offset, self.size, self.path = base, offset, size, name
        self.check = None  # the base file's check sees every read

    def _bounds(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{self.path}: read [{offset}, {offset + n}) past its end ({self.size} bytes)")

    def read_into(self, offset: int, dst: memoryview) -> None:
        self._bounds(offset, len(dst))
        self.base.read_into(self.offset + offset, dst)

    def copy_into(self, offset: int, dst: memoryview) -> None:
        self._bounds(offset, len(dst))
        self.base.copy_into(self.offset + offset, dst)

    def read(self, offset: int, n: int) -> bytes:
        self._bounds(offset, n)
        return self.base.read(self.offset + offset, n)

    def close(self) -> None:
        pass


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a single pwrite may be short); a large write to a file with an
    ``O_DIRECT`` twin skips the page cache (:mod:`ckptconv.io.direct_io`)."""
    twin = twin_of(fd, len(data))
    if twin is not None:
        pwrite_direct(fd, twin, data, offset, _pwrite_buffered)
    else:
        _pwrite_buffered(fd, data, offset)


def pwrite_passing(fd: int, data: memoryview, offset: int, consumers: Sequence[Callable[[memoryview], None]]) -> None:
    """:func:`pwrite_all`, with the bytes handed to each consumer in file order: piece by piece (:data:`CACHE_PIECE`)
    right after each piece is written, or, for a write that goes ``O_DIRECT``, all of them after it."""
    if not consumers or twin_of(fd, len(data)) is not None:
        pwrite_all(fd, data, offset)
        for consume in consumers:
            consume(data)
        return
    for start in range(0, len(data), CACHE_PIECE):
        piece = data[start:start + CACHE_PIECE]
        _pwrite_buffered(fd, piece, offset + start)
        for consume in consumers:
            consume(piece)


def _pwrite_buffered(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data[:WRITE_CHUNK], offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        data, offset = data[n:], offset + n


def chunked_range(start: int, stop: int, chunk: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, view) covering [start, stop) through one reused buffer of at most ``chunk`` bytes: the caller fills
    each view with the file's bytes at offset and uses it before taking the next."""
    if start >= stop:
        return
    buffer = memoryview(bytearray(min(chunk, stop - start)))
    while start < stop:
        n = min(len(buffer), stop - start)
        yield start, buffer[:n]
        start += n

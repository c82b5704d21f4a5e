"""Output writes that skip the page cache: the aligned middle of each large write goes out with ``O_DIRECT``.

A buffered write costs the kernel a copy of every byte into the page cache, then the flush: on the training-state
paths that copy was the largest single item of a conversion's CPU (issue #33: 1.1-1.4 CPU s/GB here, where ``cp``
spent ~0.5 on the whole copy). Files the executor creates inside :func:`direct_writes` get a second descriptor
opened with ``O_DIRECT`` (:func:`attach`); :func:`ckptconv.io.positional.pwrite_all` then sends each write of at
least :data:`MIN_DIRECT` bytes through :func:`pwrite_direct`: its unaligned head and tail (under :data:`ALIGN`
each) go through the page cache as before, its middle (aligned to 4 KiB, or to the page where pages are larger) is
written straight to the file: from where it lies
when its address is page-aligned there too (the executor places its band buffers so), else copied first into a
page-aligned buffer of the thread. Writes are disjoint and the alignment is at least a page, so a page is written
either whole by one direct write or in parts by buffered ones, never both; the buffered descriptor reads without
read-ahead, so the digest's read-back caches only pages of bytes already written (never one a direct write is
changing). The bytes on disk are the same; only the path they take changes.

A filesystem that refuses ``O_DIRECT`` (tmpfs, some FUSE mounts), a direct write it rejects as misaligned
(``EINVAL``: a device whose blocks are larger than the alignment; from then on), or a file opened past half the
descriptor limit, is written buffered: correct, only slower.

    >>> with direct_writes(True):                                   # doctest: +SKIP
    ...     fd = open_output(path)
    >>> pwrite_all(fd, view, offset); close_output(fd)              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

WRITE_IO_MODES = ("direct", "buffered")  # RunOptions.write_io / --write-io
# Alignment of direct offsets, lengths and buffer addresses: a device block (512 B or 4 KiB) and at least a page, so
# no page of the page cache ever holds bytes of a direct write beside bytes of a buffered one (16 and 64 KiB pages).
ALIGN = max(4096, mmap.PAGESIZE)
MIN_DIRECT = 1 << 20     # smaller writes (headers, descriptors, small tensors) stay buffered
BOUNCE_BYTES = 4 << 20   # per writing thread, outside --max-memory: a misaligned direct write is copied through it
IN_PLACE_CHUNK = 64 << 20  # bytes per direct pwrite from an already aligned buffer

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptconv_direct_writes", default=False)


@dataclass
class _Direct:
    fd: int       # the O_DIRECT descriptor
    inode: tuple[int, int]  # (st_dev, st_ino) of the file both descriptors name
    refused: bool = False   # the device refused a direct write: the file is written buffered from then on; the
                            # twin stays open until close_output, as other threads may be writing through it


_files: dict[int, _Direct] = {}  # buffered descriptor -> its direct twin
_lock = threading.Lock()
_local = threading.local()
direct_bytes = 0   # bytes written with O_DIRECT since import (tests and benchmarks read it)
bounced_bytes = 0  # of those, bytes copied through the bounce buffer first (the rest went from where they lay)


@contextlib.contextmanager
def direct_writes(enabled: bool) -> Iterator[None]:
    """Files attached in this block (in this thread) get an ``O_DIRECT`` twin when ``enabled``."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def open_output(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """Create (or truncate) the output file ``path`` read-write (a digest reads back what was written out of order),
    never through a symlink; with an ``O_DIRECT`` twin inside :func:`direct_writes`. Close it with
    :func:`close_output`."""
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        attach(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def close_output(fd: int) -> None:
    """Close an output file's descriptor and its twin."""
    try:
        detach(fd)
    finally:
        os.close(fd)


def attach(path: str | os.PathLike[str], fd: int) -> None:
    """Give ``fd`` (just created at ``path``, open for writing) an ``O_DIRECT`` twin, inside :func:`direct_writes`
    and where the filesystem allows it."""
    if not _ENABLED.get() or not hasattr(os, "O_DIRECT"):
        return
    # Sinks open every output file at once (an xser shard is a file per tensor): twins must not use up the
    # descriptors the files themselves need. Numbers are handed out lowest first, so ``fd`` counts those open.
    if fd >= _descriptor_limit() // 2:
        return
    try:
        twin = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # EINVAL on tmpfs and some FUSE mounts: this file stays buffered
        return
    inode = _inode(twin)
    if inode != _inode(fd):  # replaced between the two opens: never write through it
        os.close(twin)
        return
    # A kernel reading ahead for the digest's read-back would cache pages a direct write is changing: read exactly
    # the pages asked for (whole pages of written bytes: edges are buffered, so never stale).
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    with _lock:
        stale, _files[fd] = _files.get(fd), _Direct(twin, inode)
    if stale is not None:  # left by a writer that closed its file without close_output
        os.close(stale.fd)


def detach(fd: int) -> None:
    """Close ``fd``'s twin, if it has one (before ``fd`` itself is closed and its number reused)."""
    with _lock:
        direct = _files.pop(fd, None)
    if direct is not None:
        os.close(direct.fd)


def twin_of(fd: int, nbytes: int) -> int | None:
    """The ``O_DIRECT`` descriptor to write ``nbytes`` to ``fd`` through, or None (buffered)."""
    if nbytes < MIN_DIRECT or not _files:
        return None
    with _lock:
        direct = _files.get(fd)
    # A twin whose descriptor number was closed and reused for another file (a writer that did not detach) must
    # never receive that file's bytes: the inode is compared on every use (one fstat per >= 1 MiB write).
    if direct is None or direct.refused or _inode(fd) != direct.inode:
        return None
    return direct.fd


def pwrite_direct(fd: int, twin: int, data: memoryview, offset: int, buffered: Any) -> None:
    """Write ``data`` at ``offset``: the aligned middle through ``twin``, the edges with ``buffered(fd, view,
    offset)``; a middle the device rejects (EINVAL) goes buffered too, and the file stays buffered from then on."""
    end = offset + len(data)
    lo, hi = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN
    if hi - lo < ALIGN:
        buffered(fd, data, offset)
        return
    if lo > offset:
        buffered(fd, data[:lo - offset], offset)
    at, refused = _write_middle(twin, data[lo - offset:hi - offset], lo)
    if refused:
        _refuse(fd)
    if at < hi:
        buffered(fd, data[at - offset:hi - offset], at)
    if end > hi:
        buffered(fd, data[hi - offset:], hi)


def _write_middle(twin: int, data: memoryview, offset: int) -> tuple[int, bool]:
    """Write aligned ``data`` at aligned ``offset`` through ``twin``: (the offset reached, whether the device refused
    a direct write). Stops early, leaving the rest to the buffered path, on EINVAL or a short write.

    ``data`` at a page-aligned address (the executor places its band buffers at their file offset's phase) is sent
    as it is; anything else is copied through the thread's page-aligned buffer first."""
    import numpy as np

    global direct_bytes, bounced_bytes
    source = np.frombuffer(data, dtype=np.uint8)
    in_place = source.ctypes.data % ALIGN == 0
    step = IN_PLACE_CHUNK if in_place else BOUNCE_BYTES
    at = offset
    for start in range(0, len(source), step):
        n = min(step, len(source) - start)
        if in_place:
            got = _pwrite_direct_chunk(twin, data[start:start + n], at)
        else:
            bounce = _bounce()
            np.copyto(np.frombuffer(bounce, dtype=np.uint8)[:n], source[start:start + n])  # without the GIL
            with memoryview(bounce) as view:
                got = _pwrite_direct_chunk(twin, view[:n], at)
        if got is None:
            return at, True
        if got > 0 and got % ALIGN == 0:
            at += got
            with _lock:
                direct_bytes += got
                bounced_bytes += 0 if in_place else got
        if got != n:  # short (a full disk says so on the buffered retry): the rest goes buffered
            return at, False
    return at, False


def _pwrite_direct_chunk(twin: int, view: memoryview, offset: int) -> int | None:
    """One O_DIRECT pwrite: the bytes written, or None where the device refuses it (EINVAL)."""
    try:
        return os.pwrite(twin, view, offset)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


def _refuse(fd: int) -> None:
    with _lock:
        direct = _files.get(fd)
        if direct is not None:
            direct.refused = True


def _descriptor_limit() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _bounce() -> mmap.mmap:
    buffer = getattr(_local, "bounce", None)
    if buffer is None:
        buffer = _local.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous mappings are page-aligned
    return buffer


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino

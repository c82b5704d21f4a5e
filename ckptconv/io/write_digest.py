"""Digests of output files computed from the bytes as they are written, instead of reading each file back.

A :class:`WriteDigest` follows one file in file order, like :class:`ckptconv.io.checked.StreamCheck` does for
reads. Every write into the file goes through :meth:`WriteDigest.write` (pwrite, then hash): a write at the
hashed prefix is hashed from memory; one just ahead of it waits while the bytes before it are being written by
another thread; one further ahead is left on disk and read back (from the page cache) once the prefix reaches
it (or, where the writer keeps that memory unchanged until the file is finished, ``hold``, hashed from memory
then); :meth:`WriteDigest.finish` reads back whatever is still unhashed: with ``hold``, only the bytes this
process never wrote (another process's share of the file). The digest is the plain BLAKE3 (or
sha256) of the whole file, so ``b3sum`` and ``verify --files`` agree with it; only the number of bytes read
back changes (:attr:`WriteDigest.pulled`).

Writers that create a file (:class:`ckptconv.io.torchzip.TorchZipWriter`, the safetensors writer, the DCP
sink) take their digest from :func:`open_digest`, which answers only inside :func:`recording` (the executor
opens its sinks there), so a file written anywhere else is hashed from disk as before.

    >>> digests = WriteDigests("blake3")                                  # doctest: +SKIP
    >>> with recording(digests): sink = make_sink(out_file, tmp)          # doctest: +SKIP
    >>> ...; sink.finish(); digests.result(tmp / out_file.path)           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptconv.io.crc import RunningCrc
from ckptconv.io.digest import new_hasher
from ckptconv.io.positional import chunked_range, pwrite_passing

# bytes per read-back of a range written out of order: small enough that the hash finds them still in cache, and
# that the allocator hands the same memory back each time (4 MiB pulls took fresh pages, faulted in during the copy)
READ_CHUNK = 256 << 10


class WriteDigest:
    """The digest of one file being written, from its written bytes in file order."""

    def __init__(self, path: str, fd: int, algorithm: str, *, hold: bool = False) -> None:
        """``hold``: the memory of every write stays unchanged until :meth:`finish` (the writer promises it), so a
        write ahead of the prefix is hashed from that memory when the prefix reaches it, not read back."""
        self.path, self.fd = path, fd
        self._held: dict[tuple[int, int], memoryview] | None = {} if hold else None
        self._digest: Any = new_hasher(algorithm)
        self.pos = 0          # bytes [0, pos) are hashed
        self.pulled = 0       # bytes read back from the file (written ahead of pos, or never written)
        self.hexdigest: str | None = None
        self._in_flight: list[tuple[int, int]] = []  # pwrites running now
        self._ahead: list[tuple[int, int]] = []      # written ahead of pos, on disk, not hashed yet (a heap)
        self._cond = threading.Condition()
        self._helped = False  # a thread of lend_hand hashes the held writes: the writers only write
        self._help_over = False  # finish or end_help: lend_hand returns

    def claim(self, offset: int, length: int) -> Callable[[], None]:
        """A thread will write [offset, offset+length) soon (it is computing those bytes): writes just past them
        wait for them instead of being read back. Returns the release, to call once that thread is done (written
        or not). Every wait ends if each thread writes its claimed extents front to back, one after another in
        one order of (file, offset) shared by all threads (ckptconv.engine.claims): the claim at the hashed prefix
        then belongs to a thread writing there, never to one waiting."""
        claim = (offset, offset + length)
        with self._cond:
            self._in_flight.append(claim)

        def release() -> None:
            with self._cond:
                self._in_flight.remove(claim)
                self._cond.notify_all()

        return release

    def write(self, data: memoryview, offset: int, crc: RunningCrc | None = None) -> None:
        """pwrite ``data`` at ``offset``, then hash it (or leave it to be read back, see the module); ``crc`` is
        handed the bytes as they are written. A write at the hashed prefix is hashed piece by piece as it is
        written (:func:`ckptconv.io.positional.pwrite_passing`): the other threads' writes wait for its end anyway,
        since the prefix lies in it."""
        end = offset + len(data)
        if not len(data):
            return
        if self.hexdigest is not None:  # its fd may be another file's by now: write nothing
            raise AssertionError(f"{self.path}: bytes [{offset}, {end}) written after the file was finished")
        with self._cond:
            self._in_flight.append((offset, end))
            at_prefix = offset == self.pos and not self._helped
        consumers: list[Callable[[memoryview], None]] = [] if crc is None else [crc]
        try:
            pwrite_passing(self.fd, data, offset, consumers + [self._passed] if at_prefix else consumers)
        except BaseException:
            with self._cond:
                self._in_flight.remove((offset, end))
                self._cond.notify_all()
            raise
        with self._cond:
            try:
                self._in_flight.remove((offset, end))
                if at_prefix:
                    self._read_ahead()
                else:
                    self._wrote(offset, end, data)
            finally:
                self._cond.notify_all()

    def _passed(self, piece: memoryview) -> None:
        """The bytes at the prefix, hashed outside the lock by the one thread that may (the writer of the extent in
        flight there, or the helper of :meth:`lend_hand`), the prefix moved under it."""
        self._digest.update(piece)
        with self._cond:
            self.pos += len(piece)

    def _wrote(self, offset: int, end: int, data: memoryview) -> None:
        while True:  # returns once the write is hashed or left to be read back
            if self.hexdigest is not None or offset < self.pos:
                raise AssertionError(f"{self.path}: bytes [{offset}, {end}) written after the digest passed them "
                                     f"(hashed up to {self.pos})")
            if offset == self.pos and not self._helped:
                self._update(data)
                self._read_ahead()
                return
            if not self._helped and any(s <= self.pos < e for s, e in self._in_flight):
                self._cond.wait()  # the bytes at pos are being computed or written by another thread right now
                continue
            heapq.heappush(self._ahead, (offset, end))  # hashed (held) or read back once pos reaches it
            if self._held is not None:
                self._held[offset, end] = data
            return

    def _read_ahead(self, gaps: bool = False) -> None:
        """Hash the ranges written ahead of pos that pos has reached: from their memory when held, else read back.
        ``gaps`` (at finish): read back what lies between them too (bytes another process wrote)."""
        while self._ahead and (gaps or self._ahead[0][0] <= self.pos):  # a heap by start: no scan of every range
            start, end = heapq.heappop(self._ahead)
            held = None if self._held is None else self._held.pop((start, end), None)
            if start > self.pos:
                self._pull(start)
            if held is not None and start == self.pos:
                self._update(held)
            elif end > self.pos:
                self._pull(end)

    def _pull(self, stop: int) -> None:
        """Read [pos, stop) back from the file and hash it."""
        for offset, view in chunked_range(self.pos, stop, READ_CHUNK):
            done = 0
            while done < len(view):  # preadv may return short counts
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"{self.path}: unexpected end of file at {offset + done} while reading it back for "
                                  "its digest")
                done += got
            self.pulled += len(view)
            self._update(view)

    def _update(self, data: memoryview) -> None:
        self._digest.update(data)
        self.pos += len(data)

    def lend_hand(self) -> None:
        """On a thread with nothing else to do: hash the writes held in memory (``hold``) at the prefix, in file
        order, while the writer goes on writing (it then no longer hashes). Returns at :meth:`finish` or
        :meth:`end_help`, at once if the file holds nothing (no ``hold``) or is helped already."""
        with self._cond:
            if self._held is None or self._helped or self._help_over:
                return
            self._helped = True
            try:
                while not self._help_over:
                    if not (self._ahead and self._ahead[0][0] == self.pos and self._ahead[0] in self._held):
                        self._cond.wait()  # for the write at the prefix (or the end; a range written twice: finish)
                        continue
                    data = self._held.pop(heapq.heappop(self._ahead))
                    self._cond.release()  # the writers go on meanwhile: only this thread hashes now
                    try:
                        self._passed(data)
                    finally:
                        self._cond.acquire()
            finally:
                self._helped = False
                self._cond.notify_all()

    def end_help(self) -> None:
        """:meth:`lend_hand` returns (a writer that failed, say: it never finishes)."""
        with self._cond:
            self._help_over = True
            self._cond.notify_all()

    def finish(self) -> str:
        """Hash what is left (read back) and return the hex digest; call once every write is done."""
        self.end_help()
        with self._cond:
            while self._helped:  # the helping thread ends its piece first
                self._cond.wait()
            if self.hexdigest is None:
                if self._in_flight:
                    raise AssertionError(f"{self.path}: digest finished while writes {self._in_flight} run")
                self._read_ahead(gaps=self._held is not None)
                self._ahead.clear()
                self._pull(os.fstat(self.fd).st_size)
                self.hexdigest = str(self._digest.hexdigest())
            return self.hexdigest


def write_to(fd: int, data: memoryview, offset: int, digest: WriteDigest | None, crc: RunningCrc | None = None) -> None:
    """pwrite ``data`` at ``offset`` of ``fd``, through ``digest`` when the file has one; ``crc``, when given, is
    handed the bytes as they are written (while they are in cache)."""
    if digest is None:
        pwrite_passing(fd, data, offset, [] if crc is None else [crc])
    else:
        digest.write(data, offset, crc)


class WriteDigests:
    """The digests of the files created while :func:`recording` is active, by path."""

    def __init__(self, algorithm: str, *, hold: bool = False) -> None:
        """``hold``: the files' writers keep the memory of every write unchanged until the file is finished
        (:class:`WriteDigest`)."""
        self.algorithm, self.hold = algorithm, hold
        self._by_path: dict[str, WriteDigest] = {}
        self._by_inode: dict[tuple[int, int], WriteDigest] = {}
        self._lock = threading.Lock()

    def open(self, path: str | os.PathLike[str], fd: int) -> WriteDigest:
        digest = WriteDigest(os.fspath(path), fd, self.algorithm, hold=self.hold)
        st = os.fstat(fd)
        with self._lock:
            self._by_path[os.path.abspath(path)] = digest
            self._by_inode[st.st_dev, st.st_ino] = digest
        return digest

    def of_file(self, path: str | os.PathLike[str]) -> str | None:
        """The digest of the file now at ``path``, renamed there or not, if it was written and finished here (the
        same inode, every byte of it hashed); None: read it."""
        st = os.stat(path)
        with self._lock:
            digest = self._by_inode.get((st.st_dev, st.st_ino))
        if digest is None or digest.hexdigest is None or digest.pos != st.st_size:
            return None
        return digest.hexdigest

    def result(self, path: str | os.PathLike[str]) -> str | None:
        """The hex digest of the file written at ``path`` (before any rename), if it was finished here."""
        with self._lock:
            digest = self._by_path.get(os.path.abspath(path))
        return None if digest is None else digest.hexdigest

    def under(self, root: Path) -> Callable[[str], str | None]:
        """:meth:`result` by path relative to ``root`` (the directory the files were written in)."""
        return lambda rel: self.result(root / rel)

    def lend_hand(self) -> None:
        """:meth:`WriteDigest.lend_hand` to each file open now, one after another (a thread whose own files are
        written: it hashes another thread's file while that thread writes it)."""
        with self._lock:
            digests = list(self._by_path.values())
        for digest in digests:
            digest.lend_hand()

    def end_help(self) -> None:
        """Every :meth:`lend_hand` returns (a writer failed: its file is never finished)."""
        with self._lock:
            digests = list(self._by_path.values())
        for digest in digests:
            digest.end_help()

    def pulled(self) -> int:
        """Bytes read back over all files (the rest was hashed from memory)."""
        with self._lock:
            return sum(d.pulled for d in self._by_path.values())


_ACTIVE: contextvars.ContextVar[WriteDigests | None] = contextvars.ContextVar("ckptconv_write_digests", default=None)


@contextlib.contextmanager
def recording(digests: WriteDigests | None) -> Iterator[None]:
    """Files created in this block (in this thread) get a digest from ``digests`` (None: no digests)."""
    token = _ACTIVE.set(digests)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def open_digest(path: str | os.PathLike[str], fd: int) -> WriteDigest | None:
    """A digest for a file just created at ``path`` (open read-write on ``fd``), inside :func:`recording`."""
    digests = _ACTIVE.get()
    return None if digests is None else digests.open(path, fd)

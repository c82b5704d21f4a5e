"""Checked reads: a file's size, recorded digest and zip CRC-32s, checked from the bytes we read anyway.

A :class:`StreamCheck` follows one file in file order. Readers hand it every tensor-data read
(:meth:`PositionalFile.read_into`); the bytes are hashed there, while they are in memory. Reads
arrive out of order (parallel workers, plan order differing from file order): a read that starts
past the hashed prefix first hashes the gap by reading it (so the reader's own read of the gap,
moments later, comes from the page cache), a read that starts far ahead is left for later, and
:meth:`StreamCheck.finish` hashes whatever is still unhashed (zip trailers, tensors nobody asked
for). So every byte is hashed exactly once, and the whole file before a run reports success.

The same pass computes the CRC-32 of each zip record and compares it with the central directory
as the record ends, so torch zip shards without ``ckptconv.json`` (official ones) are checked too.

    >>> checks = CheckedFiles(root, records)          # records: from ckptconv.json   # doctest: +SKIP
    >>> reader = TorchZipReader(path, check=checks.open(path))                        # doctest: +SKIP
    >>> ...; checks.finish()                          # raises IntegrityError on a mismatch  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.errors import IntegrityError
from ckptconv.io.crc import crc32
from ckptconv.io.digest import FileRecord, new_hasher
from ckptconv.io.metadata import METADATA_FILE
from ckptconv.io.positional import chunked_range

# Gaps of unread bytes the check reads itself rather than leave for later: zip headers, pickles,
# alignment, small tensors nobody asked for. Larger unread gaps wait for the workers or finish().
SMALL_GAP = 1 << 20
FILL_CHUNK = 4 << 20  # bytes per read of a gap or of the rest at finish


@dataclass(frozen=True)
class ZipCrc:
    """One zip record's data extent and the CRC-32 its central directory entry records."""

    name: str
    start: int
    size: int
    crc: int

    @property
    def end(self) -> int:
        return self.start + self.size


class StreamCheck:
    """Size, digest and record CRCs of one file, computed in file order from what its reader reads."""

    def __init__(self, path: str | os.PathLike[str], record: FileRecord | None) -> None:
        self.path = os.fspath(path)
        self.record = record
        self.size = os.stat(self.path).st_size
        if record is not None and record.size != self.size:
            raise size_error(self.path, self.size, record.size)
        self._digest = new_hasher(record.algorithm) if record is not None and record.algorithm else None
        self._records: list[ZipCrc] = []
        self._next = 0       # index of the first record whose CRC is not yet checked
        self._crc = 0        # running CRC of that record's bytes hashed so far
        self.pos = 0         # bytes [0, pos) are hashed
        self.consumed = 0    # tensor bytes the reader asked for (0: nothing read, nothing to finish)
        self.pulled = 0      # bytes the check read itself (gaps ahead of out-of-order reads, the rest at finish)
        self.finished = False
        self._in_flight: list[tuple[int, int]] = []  # reads copying right now (their bytes come soon)
        self._seen: list[tuple[int, int]] = []       # ranges read ahead of pos, unhashed (in the page cache)
        self._cond = threading.Condition()

    def set_zip_records(self, records: list[ZipCrc]) -> None:
        """The records whose CRC-32s to check (called once the central directory is parsed)."""
        with self._cond:
            self._records = sorted(records, key=lambda r: r.start)

    def begin(self, offset: int, length: int) -> None:
        """A reader starts copying [offset, offset+length): a read just ahead of it waits for those bytes."""
        with self._cond:
            self._in_flight.append((offset, offset + length))

    def abandon(self, offset: int, length: int) -> None:
        """The copy announced by :meth:`begin` failed: nobody will deliver those bytes."""
        with self._cond:
            self._in_flight.remove((offset, offset + length))
            self._cond.notify_all()

    def consumed_bytes(self, offset: int, data: memoryview, fill: Any) -> None:
        """The reader copied file bytes [offset, offset+len(data)) into ``data`` (announced by
        :meth:`begin`); ``fill(offset, view)`` reads other bytes of the same file.

        Bytes at the hashed prefix are hashed now. Ahead of it, this waits for reads of the gap
        that are in flight, reads small gaps (zip headers, pickles) and ranges read earlier (from
        the page cache) itself, and otherwise leaves these bytes for later (a read the plan makes
        long before the rest, such as a replica check, must not read the file ahead of the workers).
        """
        end = offset + len(data)
        with self._cond:
            try:
                self._consume(offset, end, data, fill)
            finally:
                self._cond.notify_all()

    def _consume(self, offset: int, end: int, data: memoryview, fill: Any) -> None:
        self._in_flight.remove((offset, end))
        self.consumed += len(data)
        while not self.finished and end > self.pos:
            if offset <= self.pos:
                self._update(data[self.pos - offset:])
                return
            if any(s <= self.pos < e for s, e in self._in_flight):
                self._cond.wait()  # the bytes at pos are being read by another worker
                continue
            stop = min([s for s, _ in self._in_flight if self.pos < s < offset] + [offset])
            if stop - self.pos - self._seen_bytes(self.pos, stop) > SMALL_GAP:
                self._seen.append((offset, end))
                return
            self._hash_from_file(stop, fill)

    def _seen_bytes(self, start: int, stop: int) -> int:
        self._seen = [(s, e) for s, e in self._seen if e > self.pos]
        covered, at = 0, start
        for s, e in sorted(self._seen):
            lo, hi = max(s, at), min(e, stop)
            if lo < hi:
                covered, at = covered + hi - lo, hi
        return covered

    def finish(self, fill: Any) -> None:
        """Hash the rest of the file and compare with the record; raise IntegrityError on a mismatch."""
        with self._cond:
            if self.finished:
                return
            self._hash_from_file(self.size, fill)
            self.finished = True
            if self._next < len(self._records):  # a record past the end: the reader would have failed
                raise IntegrityError(f"{self.path}: record {self._records[self._next].name} ends past the file's end")
            if self._digest is not None and self.record is not None:
                actual = self._digest.hexdigest()
                if actual != self.record.digest:
                    raise digest_error(self.path, self.record, actual)

    def _hash_from_file(self, stop: int, fill: Any) -> None:
        for offset, view in chunked_range(self.pos, stop, FILL_CHUNK):
            fill(offset, view)
            self.pulled += len(view)
            self._update(view)

    def _update(self, data: memoryview) -> None:
        """Hash ``data``, the file's bytes starting at ``pos``; check each record CRC as its last byte passes."""
        start, end = self.pos, self.pos + len(data)
        if self._digest is not None:
            self._digest.update(data)
        while self._next < len(self._records):
            rec = self._records[self._next]
            lo, hi = max(start, rec.start), min(end, rec.end)
            if lo < hi:
                self._crc = crc32(data[lo - start:hi - start], self._crc)
            if rec.end > end:
                break
            if self._crc != rec.crc:
                raise crc_error(self.path, rec.name, self._crc, rec.crc)
            self._next += 1
            self._crc = 0
        self.pos = end


class CheckedFiles:
    """The files of one checkpoint directory as ``ckptconv.json`` records them (or without records:
    zip CRC-32s only); hands out a :class:`StreamCheck` per file opened and finishes them all.

    ``enabled=False`` (``--no-check``) hands out nothing: reads are not checked at all.
    """

    def __init__(self, root: Path, records: Mapping[str, Any] | None, *, enabled: bool = True) -> None:
        self.root = root
        self.enabled = enabled
        self.records = {rel: FileRecord.from_json(rec) if isinstance(rec, dict) else rec
                        for rel, rec in (records or {}).items()}
        self.has_records = records is not None
        self._open: dict[str, tuple[StreamCheck, Any]] = {}
        self._lock = threading.Lock()

    def record(self, path: Path) -> FileRecord | None:
        """The recorded size and digest of ``path``; an error when the directory has records but not this file."""
        if not self.has_records:
            return None
        rel = _relative(path, self.root)
        if rel not in self.records:
            raise IntegrityError(f"{path}: not listed in {self.root / METADATA_FILE}; the directory holds a file "
                                 "that its conversion did not write")
        return self.records[rel]

    def open(self, path: Path, fill: Any) -> StreamCheck | None:
        """A check for ``path``, read through ``fill(offset, view)`` when the check needs bytes itself."""
        if not self.enabled:
            return None
        check = StreamCheck(path, self.record(path))
        with self._lock:
            self._open[os.fspath(path)] = (check, fill)
        return check

    def check_sizes(self, under: str) -> None:
        """Every recorded file under ``under`` (a relative directory) exists with its recorded size."""
        if not self.enabled:
            return
        prefix = under.rstrip("/") + "/"
        for rel, rec in sorted(self.records.items()):
            if not rel.startswith(prefix):
                continue
            path = self.root / rel
            if not path.is_file():
                raise IntegrityError(f"{path}: missing; {self.root / METADATA_FILE} lists it ({rec.size} bytes)")
            size = path.stat().st_size
            if size != rec.size:
                raise size_error(path, size, rec.size)

    def finish(self, *, workers: int = 8, only_read: bool = True) -> int:
        """Hash what is left of every file that was read from (``only_read``) or opened; return how
        many files were checked. Raises IntegrityError for the first bad file in path order."""
        with self._lock:
            items = sorted(self._open.items())
        todo = [(c, fill) for _, (c, fill) in items if c.consumed or not only_read]
        if not todo:
            return 0
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            futures = [pool.submit(check.finish, fill) for check, fill in todo]
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return len(todo)


def check_whole_file(path: Path, record: FileRecord | None) -> bytes:
    """Read a small file whole and check it against ``record``; return its bytes (parse those, not the file)."""
    data = Path(path).read_bytes()
    if record is None:
        return data
    if len(data) != record.size:
        raise size_error(path, len(data), record.size)
    if record.algorithm:
        digest = new_hasher(record.algorithm)
        digest.update(data)
        if digest.hexdigest() != record.digest:
            raise digest_error(path, record, digest.hexdigest())
    return data


def size_error(path: str | os.PathLike[str], actual: int, expected: int) -> IntegrityError:
    return IntegrityError(f"{path}: {actual} bytes, {METADATA_FILE} records {expected}; the file was truncated or replaced")


def digest_error(path: str | os.PathLike[str], record: FileRecord, actual: str) -> IntegrityError:
    return IntegrityError(f"{path}: {record.algorithm} {actual}, {METADATA_FILE} records {record.digest}; the file "
                          "changed after it was written, or is another rank's shard")


def crc_error(path: str | os.PathLike[str], record: str, actual: int, expected: int) -> IntegrityError:
    return IntegrityError(f"{path}: record {record} has CRC-32 {actual:08x}, the zip directory records "
                          f"{expected:08x}; the file is corrupt")


def _relative(path: Path, root: Path) -> str:
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return Path(os.path.relpath(path, root)).as_posix()

"""Output writes through an O_DIRECT twin (ckptconv.io.direct_io): the same bytes as buffered writes, whatever the
alignment, the thread interleaving, or the device's refusals; never into another file."""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import threading
from pathlib import Path

import pytest

import ckptconv
from ckptconv.commands.api import RunOptions
from ckptconv.io import direct_io
from ckptconv.io.direct_io import ALIGN, close_output, direct_writes, open_output, twin_of
from ckptconv.io.positional import pwrite_all, pwrite_passing


def _supports_direct(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not hasattr(os, "O_DIRECT") or not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    return tmp_path


def _extents(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """Disjoint extents covering [0, size): unaligned cuts, some under MIN_DIRECT, some over a bounce buffer."""
    cuts, at = [0], 0
    while at < size:
        at = min(size, at + rng.choice([17, 4095, 70_001, direct_io.MIN_DIRECT + 123, direct_io.BOUNCE_BYTES + 4097,
                                        3 * ALIGN]))
        cuts.append(at)
    return list(itertools.pairwise(cuts))


def _write_shuffled(path: Path, payload: bytes, extents: list[tuple[int, int]], threads: int) -> None:
    fd = open_output(path)
    try:
        os.ftruncate(fd, len(payload))  # as the sinks preallocate
        view = memoryview(payload)
        queue = list(extents)
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    start, end = queue.pop()
                pwrite_all(fd, view[start:end], start)

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        close_output(fd)


def test_shuffled_unaligned_writes_from_threads_land_byte_exact(direct_dir):
    rng = random.Random(0)
    payload = rng.randbytes(3 * direct_io.BOUNCE_BYTES + 12_345)
    extents = _extents(len(payload), rng)
    rng.shuffle(extents)
    before = direct_io.direct_bytes
    with direct_writes(True):
        _write_shuffled(direct_dir / "out", payload, extents, threads=4)
    assert (direct_dir / "out").read_bytes() == payload
    # every extent of at least MIN_DIRECT bytes went direct, less its unaligned edges
    expected = sum((e // ALIGN * ALIGN) - (-(-s // ALIGN) * ALIGN) for s, e in extents if e - s >= direct_io.MIN_DIRECT)
    assert direct_io.direct_bytes - before == expected > 0


@pytest.mark.parametrize("misaligned", [0, 4])
def test_a_page_aligned_source_goes_direct_without_a_copy(direct_dir, misaligned):
    import mmap

    size = 3 * direct_io.MIN_DIRECT
    source = mmap.mmap(-1, size + ALIGN)  # page-aligned
    payload = random.Random(5).randbytes(size)
    source[misaligned:misaligned + size] = payload
    direct, bounced = direct_io.direct_bytes, direct_io.bounced_bytes
    with direct_writes(True), memoryview(source) as view:
        fd = open_output(direct_dir / "out")
        try:
            pwrite_all(fd, view[misaligned:misaligned + size], ALIGN)  # lands at a page-aligned file offset
            pwrite_all(fd, memoryview(bytes(ALIGN)), 0)
        finally:
            close_output(fd)
    assert (direct_dir / "out").read_bytes() == bytes(ALIGN) + payload
    sent = direct_io.direct_bytes - direct
    assert sent == (size if not misaligned else size // ALIGN * ALIGN)
    assert direct_io.bounced_bytes - bounced == (sent if misaligned else 0)


def test_a_direct_write_hands_its_bytes_to_the_checksums_after_it_is_written(direct_dir):
    """A write that goes O_DIRECT is not cut into cache-sized pieces (its middle would go buffered): its consumers get
    all of it at once, after it is written."""
    payload = random.Random(6).randbytes(2 * direct_io.MIN_DIRECT)
    seen: list[int] = []
    before = direct_io.direct_bytes
    with direct_writes(True):
        fd = open_output(direct_dir / "out")
        try:
            pwrite_passing(fd, memoryview(payload), 0, [lambda piece: seen.append(len(piece))])
        finally:
            close_output(fd)
    assert (direct_dir / "out").read_bytes() == payload
    assert seen == [len(payload)] and direct_io.direct_bytes - before == len(payload)


def test_outside_direct_writes_nothing_goes_direct(direct_dir):
    payload = random.Random(1).randbytes(2 * direct_io.MIN_DIRECT)
    before = direct_io.direct_bytes
    _write_shuffled(direct_dir / "out", payload, [(0, len(payload))], threads=1)
    assert (direct_dir / "out").read_bytes() == payload
    assert direct_io.direct_bytes == before


def test_a_filesystem_refusing_o_direct_is_written_buffered(direct_dir, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    payload = random.Random(2).randbytes(2 * direct_io.MIN_DIRECT + 5)
    before = direct_io.direct_bytes
    with direct_writes(True):
        _write_shuffled(direct_dir / "out", payload, [(3, len(payload)), (0, 3)], threads=1)
    assert (direct_dir / "out").read_bytes() == payload
    assert direct_io.direct_bytes == before


@pytest.mark.parametrize("failure", ["einval", "short"])
def test_a_refused_or_short_direct_write_is_completed_buffered(direct_dir, monkeypatch, failure):
    real_pwrite = os.pwrite
    twins: set[int] = set()
    real_attach = direct_io.attach

    def attach(path, fd):
        real_attach(path, fd)
        if fd in direct_io._files:  # this file's twin only: another test's file may still be registered
            twins.add(direct_io._files[fd].fd)

    def flaky(fd, data, offset):
        if fd in twins:
            if failure == "einval":
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, memoryview(data)[:ALIGN], offset)  # a short, aligned write
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_io, "attach", attach)
    monkeypatch.setattr(os, "pwrite", flaky)
    payload = random.Random(3).randbytes(2 * direct_io.MIN_DIRECT + 777)
    path = direct_dir / "out"
    with direct_writes(True):
        fd = open_output(path)
        try:
            pwrite_all(fd, memoryview(payload)[100:], 100)
            pwrite_all(fd, memoryview(payload)[:100], 0)
            # EINVAL: the file stays buffered from then on; a short write keeps its twin
            assert (twin_of(fd, direct_io.MIN_DIRECT) is None) == (failure == "einval")
            # the twin stays open either way: another thread may be writing through it right now, and a closed
            # number could be reused by another file before that write
            (twin,) = twins
            os.fstat(twin)
        finally:
            close_output(fd)
    with pytest.raises(OSError):
        os.fstat(twin)  # closed with its file
    assert path.read_bytes() == payload


def test_no_twins_where_descriptors_run_short(direct_dir, monkeypatch):
    monkeypatch.setattr(direct_io, "_descriptor_limit", lambda: 8)  # every number >= 4 is "past half the limit"
    payload = random.Random(6).randbytes(2 * direct_io.MIN_DIRECT)
    before = direct_io.direct_bytes
    with direct_writes(True):
        _write_shuffled(direct_dir / "out", payload, [(0, len(payload))], threads=1)
    assert (direct_dir / "out").read_bytes() == payload
    assert direct_io.direct_bytes == before


def test_a_reused_descriptor_number_never_writes_into_the_old_file(direct_dir):
    first, second = direct_dir / "first", direct_dir / "second"
    with direct_writes(True):
        fd = open_output(first)
    os.close(fd)  # a writer that forgot close_output: the twin of `first` stays registered under this number
    try:
        again = os.open(second, os.O_RDWR | os.O_CREAT)
        assert again == fd  # the lowest free number is reused
        payload = random.Random(4).randbytes(2 * direct_io.MIN_DIRECT)
        assert twin_of(again, len(payload)) is None
        pwrite_all(again, memoryview(payload), 0)
        os.close(again)
        assert second.read_bytes() == payload
        assert first.read_bytes() == b""
    finally:
        direct_io.detach(fd)


def test_a_conversion_writes_the_same_files_direct_and_buffered(direct_dir, tiny_models, monkeypatch):
    """to-nxd and to-dcp with every write of 8 KiB or more through the twin: byte-identical to buffered writes."""
    hf = tiny_models("direct-io", hidden=128, intermediate=320, vocab=512, layers=2, heads=4, kv_heads=2, head_dim=32)
    monkeypatch.setattr(direct_io, "MIN_DIRECT", 2 * ALIGN)
    written = {}
    for mode in ("direct", "buffered"):
        options = RunOptions(quiet=True, write_io=mode)
        direct, bounced = direct_io.direct_bytes, direct_io.bounced_bytes
        ckptconv.to_nxd(hf, direct_dir / mode / "nxd", options=options, tp=2)
        # torch zip records start 64-byte aligned, so the executor places every band at its file offset's phase:
        # nothing is copied before its direct write
        assert (direct_io.direct_bytes > direct) == (mode == "direct")
        assert direct_io.bounced_bytes == bounced
        ckptconv.to_dcp(hf, direct_dir / mode / "dcp", options=options)
        assert (direct_io.direct_bytes > direct) == (mode == "direct")
        written[mode] = {sub: json.loads((direct_dir / mode / sub / "ckptconv.json").read_text())["files"]
                         for sub in ("nxd", "dcp")}
    assert written["direct"] == written["buffered"]
    for sub in ("nxd", "dcp"):
        for rel in written["direct"][sub]:
            assert (direct_dir / "direct" / sub / rel).read_bytes() == (direct_dir / "buffered" / sub / rel).read_bytes()


def test_buffered_writes_go_in_small_pwrites(tmp_path, monkeypatch):
    """A large buffered write is cut into pwrites of at most ``WRITE_CHUNK`` bytes, as cp's are: one large pwrite
    fills the page cache with large folios, which on a VM whose balloon reports free pages cost a host fault each
    (a 336 MB file 0.8 s against 0.07-0.09 s; docs/performance.md), and the bytes land whole."""
    from ckptconv.io import positional

    sizes: list[int] = []
    real = os.pwrite

    def recorded(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        sizes.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recorded)
    data = random.Random(0).randbytes(5 * positional.WRITE_CHUNK + 123)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        pwrite_all(fd, memoryview(data), 7)
    finally:
        os.close(fd)
    assert positional.WRITE_CHUNK <= 1 << 20 and max(sizes) <= positional.WRITE_CHUNK and len(sizes) == 6
    assert (tmp_path / "f").read_bytes() == bytes(7) + data

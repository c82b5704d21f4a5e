"""Output digests computed as the bytes are written (ckptconv.io.write_digest) are the plain BLAKE3 / sha256 of the
file on disk: bands in any order, zip descriptors and tails patched in, every output kind the executor writes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

import ckptconv
import ckptconv.io.digest as digest_module
from benchmarks.reshard_optim import make_training_tag
from ckptconv.commands.api import RunOptions
from ckptconv.io import positional, write_digest
from ckptconv.io.crc import RunningCrc, crc32
from ckptconv.io.torchzip import TensorMeta, TorchZipWriter, plan_zip
from ckptconv.io.write_digest import WriteDigest, WriteDigests, recording
from tests.conftest import make_tiny_llama, wait_until, warns_no_tokenizer

QUIET = RunOptions(quiet=True, part=(0, 1))


def _reference(path: Path, algorithm: str) -> str:
    data = path.read_bytes()
    return blake3.blake3(data).hexdigest() if algorithm == "blake3" else hashlib.sha256(data).hexdigest()


def _open(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_bands_written_out_of_order_by_threads_give_the_files_digest(tmp_path: Path, algorithm: str):
    path = tmp_path / "f.bin"
    data = random.Random(0).randbytes(300_001)
    cuts = sorted(random.Random(1).sample(range(1, len(data)), 40))
    bands = list(zip([0, *cuts], [*cuts, len(data)], strict=True))
    random.Random(2).shuffle(bands)
    fd = _open(path, len(data) + 17)  # a tail never written: read back as the zeros it holds
    digest = WriteDigest(str(path), fd, algorithm)
    view = memoryview(data)
    threads = [threading.Thread(target=digest.write, args=(view[lo:hi], lo)) for lo, hi in bands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = digest.finish()
    os.close(fd)
    assert result == _reference(path, algorithm)
    assert path.read_bytes()[:len(data)] == data


def test_a_band_written_ahead_is_read_back_unless_its_predecessor_is_claimed(tmp_path: Path):
    first, second = b"a" * 1000, b"b" * 3000
    for claimed in (False, True):
        path = tmp_path / f"claimed-{claimed}"
        fd = _open(path, 4000)
        digest = WriteDigest(str(path), fd, "blake3")
        release = digest.claim(0, len(first)) if claimed else None
        ahead = threading.Thread(target=digest.write, args=(memoryview(second), len(first)))
        ahead.start()
        if not claimed:
            ahead.join()  # nothing announced before it: it is left on disk
        digest.write(memoryview(first), 0)
        ahead.join()
        if release is not None:
            release()
        assert digest.finish() == blake3.blake3(first + second).hexdigest()
        assert digest.pulled == (0 if claimed else len(second))
        os.close(fd)


def test_a_write_behind_the_hashed_prefix_is_refused(tmp_path: Path):
    fd = _open(tmp_path / "f", 8)
    digest = WriteDigest(str(tmp_path / "f"), fd, "blake3")
    digest.write(memoryview(b"12345678"), 0)
    with pytest.raises(AssertionError, match=r"bytes \[0, 4\) written after the digest passed them"):
        digest.write(memoryview(b"abcd"), 0)
    os.close(fd)


def test_a_torch_zip_written_in_bands_out_of_order_is_hashed_without_reading_it_back(tmp_path: Path):
    tensors = {"a": torch.arange(3000, dtype=torch.float32).reshape(100, 30), "b": torch.arange(77, dtype=torch.int64),
               "c": torch.arange(500, dtype=torch.float32).reshape(50, 10)}
    path = tmp_path / "m.pt"
    digests = WriteDigests("blake3")
    with recording(digests):
        writer = TorchZipWriter(path, plan_zip(path, {k: TensorMeta.of(t) for k, t in tensors.items()}))
    flat = {k: t.reshape(-1).view(torch.uint8) for k, t in tensors.items()}
    bands = [(k, lo, min(lo + 1000, len(v))) for k, v in flat.items() for lo in range(0, len(v), 1000)]
    releases = [writer.claim(k, lo, hi - lo) for k, lo, hi in bands]  # every band in flight, as the executor's
    random.Random(3).shuffle(bands)
    threads = [threading.Thread(target=writer.write_extent, args=(k, lo, flat[k][lo:hi])) for k, lo, hi in bands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for release in releases:
        release()
    writer.finish()
    (tmp_path / "ref").mkdir()
    torch.save(tensors, tmp_path / "ref" / "m.pt")  # the archive name follows the file name
    assert path.read_bytes() == (tmp_path / "ref" / "m.pt").read_bytes()
    assert digests.result(path) == blake3.blake3(path.read_bytes()).hexdigest()
    assert digests.pulled() < 4096, "headers and descriptors at most are read back, never a band"


def test_a_record_written_again_after_it_filled_fails_finish(tmp_path: Path):
    """Bytes written twice into a record whose descriptor was already written (as it filled) leave a zip with a
    wrong CRC: finish() names the overlap instead of completing the file (with a digest, the second write is
    refused at once: the digest had passed those bytes)."""
    path = tmp_path / "m.pt"
    tensor = torch.arange(4, dtype=torch.float32)
    writer = TorchZipWriter(path, plan_zip(path, {"w": TensorMeta.of(tensor)}))
    writer.write_extent("w", 0, tensor.view(torch.uint8))
    writer.write_extent("w", 0, torch.tensor([9.0]).view(torch.uint8))
    with pytest.raises(ValueError, match="twice"):
        writer.finish()
    writer.close()
    with recording(WriteDigests("blake3")):
        hashed = TorchZipWriter(tmp_path / "h.pt", plan_zip(tmp_path / "h.pt", {"w": TensorMeta.of(tensor)}))
    hashed.write_extent("w", 0, tensor.view(torch.uint8))
    with pytest.raises(AssertionError, match="after the digest passed them"):
        hashed.write_extent("w", 0, torch.tensor([9.0]).view(torch.uint8))
    hashed.close()


def test_a_failing_claim_releases_the_claims_already_made(tmp_path: Path):
    """A band claiming extents in several files whose second claim fails (a key the sink does not hold) leaves no
    claim standing: a claim left behind would keep every writer behind it waiting."""
    from ckptconv.core.plan import OutTensor
    from ckptconv.engine.claims import claim_band

    made, released = [], []

    class Sink:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def claim(self, key: str, offset: int, length: int):  # type: ignore[no-untyped-def]
            if self.fails:
                raise KeyError(key)
            made.append(key)
            return lambda: released.append(key)

    tensor = OutTensor(key="w", dtype=torch.float32, shape=(4, 2), dim=0, pieces=())
    with pytest.raises(KeyError):
        claim_band([(0, tensor), (1, tensor)], [(0, 32), (0, 32)], {0: Sink(False), 1: Sink(True)})
    assert made == released == ["w"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    """Every output kind, each converted while ``file_digest`` (reading a file back) was recorded."""
    root = tmp_path_factory.mktemp("write-digest")
    hf = make_tiny_llama(root / "hf", hidden=64, heads=8, kv_heads=2, intermediate=96, layers=2)
    read_back: list[str] = []
    original = digest_module.file_digest

    def spy(path: Path, algorithm: str) -> str:
        read_back.append(Path(path).name)
        return original(path, algorithm)

    made: dict[str, tuple[Path, list[str]]] = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(digest_module, "file_digest", spy)
    try:
        def run(name: str, convert, warns: bool = False) -> None:  # type: ignore[no-untyped-def]
            read_back.clear()
            if warns:
                with warns_no_tokenizer():
                    convert(root / name)
            else:
                convert(root / name)
            made[name] = (root / name, list(read_back))

        run("nxd", lambda out: ckptconv.to_nxd(hf, out, tp=2, fuse_qkv=True, attention="qkv_linear", options=QUIET))
        run("xser", lambda out: ckptconv.to_nxd(hf, out, tp=2, flavour="xser-split", options=QUIET))
        run("safetensors", lambda out: ckptconv.to_hf(root / "nxd", out, max_shard_size=50_000, options=QUIET),
            warns=True)
        make_training_tag(root / "nxd", "CosineAnnealing", tp=2)
        run("tag", lambda out: ckptconv.reshard(root / "nxd", out, tp=1, pp=1, options=QUIET))
        run("nxd-optimizer", lambda out: ckptconv.reshard(root / "nxd", out, tp=1, pp=1, optimizer_format="nxd",
                                                          options=QUIET))
        run("dcp", lambda out: ckptconv.to_dcp(root / "nxd", out, options=QUIET))
    finally:
        mp.undo()
    return made


@pytest.mark.parametrize("kind", ["nxd", "xser", "safetensors", "tag", "nxd-optimizer", "dcp"])
def test_recorded_digests_are_the_files_blake3_and_data_files_are_not_read_back(outputs, kind: str):
    out, read_back = outputs[kind]
    records = json.loads((out / "ckptconv.json").read_text())["files"]
    data_files = [rel for rel in records if rel.endswith((".pt", ".safetensors", ".distcp"))]
    assert data_files, f"{kind}: no data files recorded"
    for rel, record in records.items():
        assert record["blake3"] == blake3.blake3((out / rel).read_bytes()).hexdigest(), f"{kind}: {rel}"
    size = {rel: (out / rel).stat().st_size for rel in data_files}
    as_written = sum(size[rel] for rel in data_files if Path(rel).name not in read_back)
    # small files written outside the executor's bands (xser's refs and .info.pt, side files) are read back
    assert as_written >= 0.9 * sum(size.values()), f"{kind}: read back {read_back}"


def test_a_held_digest_reads_back_only_what_another_process_wrote(tmp_path: Path):
    """``hold``: this process's writes ahead of the prefix are hashed from their memory at finish; only the ranges
    it never wrote (another process's share of the file, written through another fd) are read back."""
    path, size = tmp_path / "shared.bin", 1 << 20
    data = bytes(random.Random(3).randrange(256) for _ in range(size))
    fd = _open(path, size)
    mine = [(0, 1000), (5000, 9000), (20000, 300000), (400000, size)]  # the rest is the other process's
    digest = WriteDigest(str(path), fd, "blake3", hold=True)
    for start, end in reversed(mine):  # out of order too
        digest.write(memoryview(data[start:end]), start)
    other = os.open(path, os.O_WRONLY)
    for (_, start), (end, _) in zip(mine, mine[1:], strict=False):
        os.pwrite(other, data[start:end], start)
    os.close(other)
    assert digest.finish() == blake3.blake3(data).hexdigest() == _reference(path, "blake3")
    assert digest.pulled == size - sum(end - start for start, end in mine)
    os.close(fd)


class _Recording:
    """A BLAKE3 hasher that tells ``seen`` the size of every update (on the thread that makes it)."""

    def __init__(self, seen: Callable[[int], None]) -> None:
        self.inner, self.seen = blake3.blake3(), seen

    def update(self, data: memoryview) -> None:
        self.seen(len(data))
        self.inner.update(data)

    def hexdigest(self) -> str:
        return str(self.inner.hexdigest())


def test_a_write_at_the_prefix_is_checksummed_and_hashed_piece_by_piece_as_it_is_written(tmp_path: Path,
                                                                                        monkeypatch):
    """One pass over memory: each piece of at most CACHE_PIECE bytes is CRC'd and hashed right after its pwrites,
    before the next piece is written (while it is in cache); a write ahead of the prefix gets its CRC all the same."""
    events: list[tuple[str, int]] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        events.append(("write", offset))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(positional.os, "pwrite", pwrite)
    monkeypatch.setattr(write_digest, "new_hasher", lambda algorithm: _Recording(lambda n: events.append(("hash", n))))
    path, first = tmp_path / "f.bin", 3 * positional.CACHE_PIECE + 123
    data = random.Random(4).randbytes(first + 5000)
    fd = _open(path, len(data))
    digest = WriteDigest(str(path), fd, "blake3")
    ahead, at_prefix = RunningCrc(), RunningCrc()
    digest.write(memoryview(data)[first:], first, ahead)  # not at the prefix: left on disk, read back later
    digest.write(memoryview(data)[:first], 0, at_prefix)
    assert digest.finish() == blake3.blake3(data).hexdigest() == _reference(path, "blake3")
    assert (at_prefix.value, ahead.value) == (crc32(data[:first]), crc32(data[first:]))
    os.close(fd)
    hashed = [n for kind, n in events if kind == "hash"]
    assert hashed[:4] == [positional.CACHE_PIECE] * 3 + [123]  # the prefix write, piece by piece
    assert sum(hashed) == len(data) and digest.pulled == 5000
    # between two hashed pieces of the prefix write: the next piece's pwrites, and nothing is hashed ahead of them
    prefix = events[1:events.index(("hash", 123)) + 1]  # events[0]: the write ahead
    pieces = [i for i, (kind, _) in enumerate(prefix) if kind == "hash"]
    writes_per_piece = -(-positional.CACHE_PIECE // positional.WRITE_CHUNK)
    assert pieces == [(k + 1) * (writes_per_piece + 1) - 1 for k in range(3)] + [len(prefix) - 1]
    assert [offset for kind, offset in prefix if kind == "write"] == list(range(0, first, positional.WRITE_CHUNK))


def test_a_thread_done_with_its_own_file_hashes_the_writes_of_another(tmp_path: Path, monkeypatch):
    """lend_hand: once a second thread lends a hand, the writer only writes; the helper hashes its held writes in
    file order (nothing read back), and the digest is the file's."""
    hashed_by: dict[int, int] = {}

    def hashed(n: int) -> None:
        hashed_by[threading.get_ident()] = hashed_by.get(threading.get_ident(), 0) + n

    monkeypatch.setattr(write_digest, "new_hasher", lambda algorithm: _Recording(hashed))
    piece, path = 65536, tmp_path / "optim.bin"
    data = random.Random(7).randbytes(8 * piece)
    fd = _open(path, len(data))
    digest = WriteDigest(str(path), fd, "blake3", hold=True)
    digest.write(memoryview(data)[:piece], 0)  # before any help: hashed by the writer
    helper = threading.Thread(target=digest.lend_hand)
    helper.start()
    wait_until(lambda: digest._helped, "the helper", 10, poll=0.001)
    for start in range(piece, len(data), piece):
        digest.write(memoryview(data)[start:start + piece], start)
    wait_until(lambda: digest.pos == len(data), "the helper to hash every write", 10, poll=0.001)
    assert digest.finish() == blake3.blake3(data).hexdigest() == _reference(path, "blake3")
    helper.join(10)
    os.close(fd)
    assert not helper.is_alive() and digest.pulled == 0
    assert hashed_by == {threading.get_ident(): piece, helper.ident: 7 * piece}


def test_a_helper_is_freed_by_end_help_and_a_file_without_held_memory_gets_none(tmp_path: Path):
    fd = _open(tmp_path / "f", 200)
    digest = WriteDigest(str(tmp_path / "f"), fd, "blake3", hold=True)
    helper = threading.Thread(target=digest.lend_hand)
    helper.start()
    wait_until(lambda: digest._helped, "the helper", 10, poll=0.001)
    digest.write(memoryview(b"x" * 100), 100)  # the bytes before it are never written: the helper waits for them
    digest.end_help()  # the writer failed: the file is never finished
    helper.join(10)
    assert not helper.is_alive()
    unheld = WriteDigest(str(tmp_path / "f"), fd, "blake3")
    unheld.lend_hand()  # returns at once: nothing of its writes stays in memory to hash
    assert not unheld._helped
    os.close(fd)


@pytest.mark.parametrize("seed", range(8))
def test_a_helper_joining_at_any_moment_of_writes_in_and_out_of_order_gives_the_files_digest(tmp_path: Path,
                                                                                            seed: int):
    """The writer writes pieces of random sizes, mostly in order, some ahead of the prefix, while a second thread
    lends a hand from a random moment on (or never): the digest is the file's, and nothing is read back."""
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(200_000, 900_000))
    cuts = sorted(rng.sample(range(1, len(data)), 30))
    pieces = list(zip([0, *cuts], [*cuts, len(data)], strict=True))
    for i in range(0, len(pieces) - 1, 5):  # every fifth pair swapped: a write ahead of the prefix
        pieces[i], pieces[i + 1] = pieces[i + 1], pieces[i]
    fd = _open(tmp_path / "f.bin", len(data))
    digest = WriteDigest(str(tmp_path / "f.bin"), fd, "blake3", hold=True)
    helper = threading.Thread(target=digest.lend_hand)
    join_at = rng.randrange(len(pieces) + 1)  # len(pieces): after the last write, just before finish
    for i, (start, end) in enumerate(pieces):
        if i == join_at:
            helper.start()
        digest.write(memoryview(data)[start:end], start)
    if join_at == len(pieces):
        helper.start()
    assert digest.finish() == blake3.blake3(data).hexdigest() == _reference(tmp_path / "f.bin", "blake3")
    helper.join(10)
    os.close(fd)
    assert not helper.is_alive() and digest.pulled == 0

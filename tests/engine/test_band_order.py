"""Bands start in the order their bytes lie in each output file, and expert bands announce what they will write, so
that each file's digest hashes the bytes as they are written instead of reading them back
(ckptconv.io.write_digest): a safetensors file orders its tensors by dtype and name, not as the plan lists them,
and a band of experts (whole slabs or a part of one) claims its extent like a band of rows. Outputs equal HF's
tensors as the safetensors library reads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.core.plan import OutTensor, Piece, Source
from ckptconv.engine.claims import claim_band, write_order
from ckptconv.io import write_digest
from ckptconv.io.safetensors_sink import SafetensorsSink
from tests.conftest import warns_no_tokenizer
from tests.moe_tags import one_layer_mixtral, tiny_moe

H, I, E = 64, 96, 4  # noqa: E741  hidden != expert intermediate, more experts than top-k


@pytest.fixture(scope="module")
def nxd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("order")
    one_layer_mixtral(root / "hf", H, I, E, head_dim=16)
    ckptconv.to_nxd(root / "hf", root / "nxd", tp=2, ep=2, options=ckptconv.RunOptions(quiet=True, workers=1))
    return root / "hf", root / "nxd"


def _read_back(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each output file's digest read back from disk, appended as each file finishes."""
    pulled: list[int] = []
    finish = write_digest.WriteDigest.finish

    def counted(self: write_digest.WriteDigest) -> str:
        done = self.hexdigest is not None
        digest = finish(self)
        if not done:
            pulled.append(self.pulled)
        return digest

    monkeypatch.setattr(write_digest.WriteDigest, "finish", counted)
    return pulled


def test_one_worker_writes_each_file_front_to_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """to-hf of a Qwen3-MoE (an expert's gate and up, built by one band, lie side by side in the file; Mixtral's w1
    and w3 have w2 between them) on one worker: nothing read back (the plan's order put lm_head, first in the
    file, last), and the model equals HF's."""
    hf = tiny_moe("qwen3_moe", tmp_path / "in")
    ckptconv.to_nxd(hf, tmp_path / "nxd", tp=2, ep=2, options=ckptconv.RunOptions(quiet=True, workers=1))
    pulled = _read_back(monkeypatch)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=ckptconv.RunOptions(quiet=True, workers=1))
    assert pulled and sum(pulled) == 0, f"{sum(pulled)} bytes read back for the digest"
    back, source = load_file(tmp_path / "hf" / "model.safetensors"), load_file(hf / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


@pytest.mark.parametrize("max_memory", [None, 1 << 20], ids=["whole slabs", "parts"])
def test_expert_bands_claim_what_they_write(nxd: tuple[Path, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, max_memory: int | None):
    """Every extent an expert band writes was claimed before it was written, whole slabs and parts of them."""
    hf, shards = nxd
    claimed: set[tuple[str, int, int]] = set()
    unclaimed: list[tuple[str, int, int]] = []
    claim, write = SafetensorsSink.claim, SafetensorsSink.write_extent

    def claiming(self: SafetensorsSink, key: str, offset: int, nbytes: int):  # type: ignore[no-untyped-def]
        claimed.add((key, offset, nbytes))
        return claim(self, key, offset, nbytes)

    def writing(self: SafetensorsSink, key: str, offset: int, data: torch.Tensor) -> None:
        extent = (key, offset, data.numel() * data.element_size())
        if extent not in claimed:
            unclaimed.append(extent)
        write(self, key, offset, data)

    monkeypatch.setattr(SafetensorsSink, "claim", claiming)
    monkeypatch.setattr(SafetensorsSink, "write_extent", writing)
    options = ckptconv.RunOptions(quiet=True, workers=2, **({"max_memory": max_memory} if max_memory else {}))
    with warns_no_tokenizer():
        ckptconv.to_hf(shards, tmp_path / "hf", options=options)
    assert any(".experts." in key for key, _, _ in claimed)
    assert unclaimed == [], "expert bands wrote extents they had not claimed"
    back, source = load_file(tmp_path / "hf" / "model.safetensors"), load_file(hf / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


class _Sink:
    """A sink whose tensors lie at ``places`` in its file; records the claims."""

    def __init__(self, places: dict[str, int]) -> None:
        self.places = places
        self.claims: list[tuple[str, int, int]] = []
        self.released: list[tuple[str, int, int]] = []

    def file_offset(self, key: str, offset: int) -> int:
        return self.places[key] + offset

    def claim(self, key: str, offset: int, nbytes: int):  # type: ignore[no-untyped-def]
        self.claims.append((key, offset, nbytes))
        return lambda: self.released.append((key, offset, nbytes))


def _uint8(key: str) -> OutTensor:
    return OutTensor(key, torch.uint8, (10, 10), 0, (Piece(Source(None, "src"), 0, 10),))


@pytest.mark.parametrize("up_at", [100, 164], ids=["back to back", "apart"])
def test_a_band_of_tensors_back_to_back_claims_one_extent(up_at: int):
    """Two 100-byte tensors of one band: back to back in their file (an expert's HF gate and up), one claim, given
    up once both are written; apart, a claim each, each given up as soon as its tensor is written."""
    sink = _Sink({"gate": 0, "up": up_at})
    claims = claim_band([(0, _uint8("gate")), (0, _uint8("up"))], [(0, 100), (0, 100)], {0: sink})
    try:
        assert sink.claims == ([("gate", 0, 200)] if up_at == 100 else [("gate", 0, 100), ("up", 0, 100)])
        claims.written(0)
        assert sink.released == ([] if up_at == 100 else [("gate", 0, 100)])
    finally:
        claims.release()
    assert sorted(sink.released) == sorted(sink.claims)


def test_a_band_writes_its_tensors_in_file_order():
    """A band's tensors are written by file, then by where their extents lie."""
    tensors = [(1, _uint8("a")), (0, _uint8("w3")), (0, _uint8("w1"))]
    places = {"a": 0, "w1": 0, "w3": 300}
    assert write_order(tensors, [(0, 100), (0, 100), (50, 50)], lambda i, t: places[t.key]) == [2, 1, 0]


SIZE = 100


def _run_bands(tmp_path: Path, places: dict[str, tuple[int, int]], bands: list[list[str]], late: int) -> list[int]:
    """Write 100-byte tensors ``places`` (key: (file index, byte offset)) into two files through their digests, one
    thread per band of ``bands`` (its tensors' keys, in the order the plan lists them), each claiming its tensors,
    then writing them in :func:`write_order`; band ``late`` starts writing 50 ms after the others. Returns the bytes
    each file's digest read back, after checking each digest against the file's BLAKE3 (no thread may hang)."""
    import threading

    from ckptconv.io.digest import file_digest

    data = {k: torch.full((SIZE,), n + 1, dtype=torch.uint8) for n, k in enumerate(places)}
    digests, fds = [], []
    for f in range(2):
        path = tmp_path / f"file{f}"
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        os.ftruncate(fds[-1], SIZE * sum(1 for i, _ in places.values() if i == f))
        digests.append(write_digest.WriteDigest(str(path), fds[-1], "blake3"))

    class DigestSink:
        def __init__(self, f: int) -> None:
            self.f = f

        def file_offset(self, key: str, offset: int) -> int:
            return places[key][1] + offset

        def claim(self, key: str, offset: int, nbytes: int):  # type: ignore[no-untyped-def]
            return digests[self.f].claim(self.file_offset(key, offset), nbytes)

    sinks = {f: DigestSink(f) for f in range(2)}
    all_claimed, errors = threading.Barrier(len(bands)), []

    def band(keys: list[str], delay: bool) -> None:
        try:
            tensors = [(places[k][0], _uint8(k)) for k in keys]
            claims = claim_band(tensors, [(0, SIZE)] * len(keys), sinks)
            all_claimed.wait()
            if delay:
                threading.Event().wait(0.05)
            try:
                for n in write_order(tensors, [(0, SIZE)] * len(keys), lambda i, t: places[t.key][1]):
                    file_index, offset = places[keys[n]]
                    digests[file_index].write(memoryview(data[keys[n]].numpy()), offset)
                    claims.written(n)
            finally:
                claims.release()
        except BaseException as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    threads = [threading.Thread(target=band, args=(keys, n == late), daemon=True) for n, keys in enumerate(bands)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "the bands deadlocked"
        assert errors == []
        for f in range(2):
            assert digests[f].finish() == file_digest(tmp_path / f"file{f}", "blake3")
        return [d.pulled for d in digests]
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("late", [0, 1], ids=["w1-w3 band late", "w2 band late"])
def test_a_band_waits_for_the_band_between_its_extents(tmp_path: Path, late: int):
    """Mixtral's HF file: one band writes w1 and w3 (from the same NxD rows), another w2, which lies between them.
    Whichever band writes first, the w1/w3 band waits for w2 once w1 is written: nothing is read back."""
    places = {"w1": (0, 0), "w2": (0, SIZE), "w3": (0, 2 * SIZE), "other": (1, 0)}
    assert _run_bands(tmp_path, places, [["w3", "w1"], ["w2"], ["other"]], late) == [0, 0]


@pytest.mark.parametrize("late", [0, 1], ids=["first band late", "second band late"])
def test_bands_writing_two_files_wait_for_each_other_without_deadlock(tmp_path: Path, late: int):
    """Two bands each writing an extent of both files, the first band's extent first in file 0 and second in file 1:
    written in the plan's order (the second band listing file 1 first), each would wait for the other's claim; in
    the shared order (file 0, then file 1) each waits at most for the other's earlier extent, and nothing is read
    back."""
    places = {"a0": (0, SIZE), "a1": (1, 0), "b0": (0, 0), "b1": (1, SIZE)}
    assert _run_bands(tmp_path, places, [["a0", "a1"], ["b1", "b0"]], late) == [0, 0]

"""Bands start in the order their bytes lie in each output file, and expert bands announce what they will write, so
that each file's digest hashes the bytes as they are written instead of reading them back
(ckptconv.io.write_digest): a safetensors file orders its tensors by dtype and name, not as the plan lists them,
and a band of experts (whole slabs or a part of one) claims its extent like a band of rows. Outputs equal HF's
tensors as the safetensors library reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
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
        self.places, self.claims = places, []  # type: list[tuple[str, int, int]]

    def file_offset(self, key: str, offset: int) -> int:
        return self.places[key] + offset

    def claim(self, key: str, offset: int, nbytes: int):  # type: ignore[no-untyped-def]
        self.claims.append((key, offset, nbytes))
        return lambda: None


@pytest.mark.parametrize("up_at", [100, 164], ids=["back to back", "apart"])
def test_a_band_of_tensors_back_to_back_claims_one_extent_and_may_wait(up_at: int):
    """Two 100-byte tensors of one band: back to back in their file (an expert's HF gate and up), one claim, and the
    band's writes may wait for the bytes before them; apart, a claim each and they never wait."""
    from ckptconv.core.plan import OutTensor, Piece, Source
    from ckptconv.engine.claims import claim_band

    def tensor(key: str) -> OutTensor:
        return OutTensor(key, torch.uint8, (10, 10), 0, (Piece(Source(None, "src"), 0, 10),))

    sink = _Sink({"gate": 0, "up": up_at})
    release = claim_band([(0, tensor("gate")), (0, tensor("up"))], 0, 10, {0: sink}, extents=[(0, 100), (0, 100)])
    try:
        assert sink.claims == ([("gate", 0, 200)] if up_at == 100 else [("gate", 0, 100), ("up", 0, 100)])
        assert write_digest.may_wait() == (up_at == 100)
    finally:
        release()
    assert write_digest.may_wait()

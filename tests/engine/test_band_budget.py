"""Every band inside its budget when single matrices are larger than a band (405B's shapes, scaled down): row bands
(the fused QKV with replicated K/V heads, the embedding), column bands (``down_proj``) and the column-major
``o_proj`` of QKV linear, built from column blocks of its source instead of whole. Outputs are compared byte for byte
with an unbudgeted run and, for ``o_proj``, with the HF matrix read by the safetensors library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptconv
from ckptconv.engine import execute
from ckptconv.io import hf as hf_io
from ckptconv.io import nxd_read
from tests.conftest import hf_state, warns_no_tokenizer
from tests.engine.test_memory_and_resume import CONFIG, synthetic_hf

# o_proj (fp32, 512 x 512) is 1 MiB, down_proj 3 MiB: at 2 workers and 4 MiB a band gets 1 MiB (the floor)
SHAPE = CONFIG | dict(vocab_size=2048, num_hidden_layers=1)
BUDGET = 4 * 2**20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("budget") / "hf"
    synthetic_hf(src, SHAPE)
    return src


def convert(src: Path, out: Path, max_memory: int, io: str = "read", dtype: str = "keep") -> None:
    options = ckptconv.RunOptions(quiet=True, workers=2, max_memory=max_memory, io=io)
    ckptconv.to_nxd(src, out, tp=4, kv_size_multiplier=2, attention="qkv_linear", fuse_qkv=True, dtype=dtype,
                    options=options)


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "model").iterdir())}


@pytest.fixture(scope="module")
def unbudgeted(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("whole") / "nxd"
    convert(model, out, 2**34)
    return files(out)


def band_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(bytes budgeted, a band's share: what end_band keeps, overflows so far) of every band run from now on."""
    bands: list[tuple[int, int, int]] = []
    start_band, end_band = execute._Scratch.start_band, execute._Scratch.end_band

    def start(self: execute._Scratch, nbytes: int) -> None:
        self.budgeted = nbytes
        start_band(self, nbytes)

    def end(self: execute._Scratch, keep: int) -> None:
        bands.append((self.budgeted, keep, self.overflows))
        end_band(self, keep)

    monkeypatch.setattr(execute._Scratch, "start_band", start)
    monkeypatch.setattr(execute._Scratch, "end_band", end)
    return bands


def check_within_share(bands: list[tuple[int, int, int]]) -> None:
    """No band was budgeted more than a band's share, and none carved a buffer past what it was budgeted."""
    share = bands[0][1]
    assert share == 2**20
    assert max(budgeted for budgeted, _, _ in bands) <= share, "a band was budgeted past its share"
    assert max(overflows for _, _, overflows in bands) == 0, "a band's buffers outgrew its budget"


@pytest.mark.parametrize("io", ["read", "mmap", "rows"])
def test_every_band_within_its_budget(model: Path, unbudgeted: dict[str, bytes], tmp_path: Path, io: str,
                                      monkeypatch: pytest.MonkeyPatch):
    """to-nxd: every band within a band's share; "rows": a reader without column reads (whole rows, cut to the
    block's columns)."""
    bands = band_log(monkeypatch)
    if io == "rows":
        monkeypatch.setattr(hf_io.HfCheckpoint, "read_columns", lambda *args: False)
    out = tmp_path / "nxd"
    convert(model, out, BUDGET, "read" if io == "rows" else io)
    check_within_share(bands)
    assert files(out) == unbudgeted


def test_cast_bands_within_their_budget(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """fp32 in, bf16 out: each band's cast buffer is budgeted too; the bytes are the unbudgeted run's."""
    convert(model, tmp_path / "whole", 2**34, dtype="bf16")
    bands = band_log(monkeypatch)
    convert(model, tmp_path / "nxd", BUDGET, dtype="bf16")
    check_within_share(bands)
    assert files(tmp_path / "nxd") == files(tmp_path / "whole")


def test_column_major_o_proj_round_trips(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every tp rank's o_proj, written in column blocks, is stored column-major, and to-hf in the same budget gives
    back HF's matrices exactly, as the safetensors library reads both."""
    out = tmp_path / "nxd"
    convert(model, out, BUDGET)
    for path in sorted((out / "model").iterdir()):
        shard = torch.load(path, weights_only=True)["model.layers.0.self_attn.o_proj.weight"]
        assert shard.stride() == (1, SHAPE["hidden_size"])
    bands = band_log(monkeypatch)
    with warns_no_tokenizer():  # to-hf: HF's o_proj banded by rows, read from column-major shards a run per column
        ckptconv.to_hf(out, tmp_path / "back", options=ckptconv.RunOptions(quiet=True, workers=2, max_memory=BUDGET))
    check_within_share(bands)
    original, back = hf_state(model), hf_state(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[key], back[key]) for key in original)


def column_reads(monkeypatch: pytest.MonkeyPatch, reads: str) -> list[bool]:
    """What every column read of an NxD shard answered ("columns"); each declined ("rows": whole rows, cut)."""
    answers: list[bool] = []
    read_columns = nxd_read.NxdCheckpoint.read_columns

    def spy(self: nxd_read.NxdCheckpoint, *args: Any) -> bool:
        answers.append(reads == "columns" and read_columns(self, *args))
        return answers[-1]

    monkeypatch.setattr(nxd_read.NxdCheckpoint, "read_columns", spy)
    return answers


@pytest.mark.parametrize("reads", ["columns", "rows"])
def test_reshard_of_column_major_shards_within_budget(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      reads: str):
    """reshard tp 4 -> 2 (o_proj column-major on both sides: built in column blocks of column-major shards) in the
    budget, byte-equal to an unbudgeted reshard, and back to HF exactly; "columns": each block one run of a shard
    (its CRCs still checked), "rows": a reader without column reads (whole rows, cut to the block)."""
    convert(model, tmp_path / "nxd", 2**34)
    whole = ckptconv.RunOptions(quiet=True, workers=2, max_memory=2**34)
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "whole", tp=2, kv_size_multiplier=1, options=whole)
    bands = band_log(monkeypatch)
    answers = column_reads(monkeypatch, reads)
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "tp2", tp=2, kv_size_multiplier=1,
                     options=ckptconv.RunOptions(quiet=True, workers=2, max_memory=BUDGET))
    assert answers and all(answers) == (reads == "columns")
    check_within_share(bands)
    assert files(tmp_path / "tp2") == files(tmp_path / "whole")
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "tp2", tmp_path / "back", options=whole)
    original, back = hf_state(model), hf_state(tmp_path / "back")
    assert all(torch.equal(original[key], back[key]) for key in original) and original.keys() == back.keys()

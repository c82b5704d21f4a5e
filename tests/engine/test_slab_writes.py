"""Expert slabs are built where their O_DIRECT write sends them from: at their file offset's page phase, so no expert
byte is copied into an aligned bounce buffer first (io.direct_io counts those), to NxD and back to HF; and the slabs
built by transposing stacked rows (NxD's gate_up_proj from HF gate and up rows, HF's down_proj from every tp rank's
NxD slab), a chunk of rows at a time, equal torch's own slicing and transposing of the HF matrices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.io import direct_io
from ckptconv.io.nxd_read import load_shard
from tests.conftest import warns_no_tokenizer
from tests.moe_tags import one_layer_mixtral

H, I, E = 256, 2048, 2  # noqa: E741  fp32 experts of 2 MiB: every tp 2 slab is at least direct_io.MIN_DIRECT


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixtral")
    one_layer_mixtral(out, H, I, E, head_dim=64)
    return out


def test_expert_slabs_go_direct_without_a_bounce_and_equal_torch(mixtral: Path, tmp_path: Path):
    options = ckptconv.RunOptions(quiet=True, workers=2, write_io="direct")
    direct, bounced = direct_io.direct_bytes, direct_io.bounced_bytes
    ckptconv.to_nxd(mixtral, tmp_path / "nxd", tp=2, options=options)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)
    if direct_io.direct_bytes == direct:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    experts = 2 * 3 * E * H * I * 4  # both directions
    assert direct_io.direct_bytes - direct >= experts * 9 // 10  # each write's unaligned edges go buffered
    assert direct_io.bounced_bytes == bounced, "an expert slab was copied to an aligned buffer before its write"

    _equal_torch(mixtral, tmp_path, tp=2, inter=I, experts=E)


def _equal_torch(source: Path, tmp_path: Path, tp: int, inter: int, experts: int) -> None:
    """Every tp rank's NxD experts under ``tmp_path / "nxd"`` equal torch's slices and transposes of the HF matrices
    of ``source``, and the HF model under ``tmp_path / "hf"`` equals ``source``."""
    hf = load_file(source / "model.safetensors")
    w = "model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
    part = inter // tp
    for rank in range(tp):
        shard = load_shard(tmp_path / "nxd" / "model" / f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")
        rows = slice(rank * part, (rank + 1) * part)
        for e in range(experts):
            gate_up = torch.cat([hf[w.format(e=e, w="w1")][rows], hf[w.format(e=e, w="w3")][rows]]).t()
            assert torch.equal(shard["model.layers.0." + NXD_GATE_UP][e], gate_up)
            assert torch.equal(shard["model.layers.0." + NXD_DOWN][e], hf[w.format(e=e, w="w2")][:, rows].t())
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gathered_slabs_in_chunks_equal_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int):
    """gate_up_proj (to-nxd) and HF's down_proj (to-hf) read and transposed 64 stored rows at a time: pieces of 600 / tp
    rows end in a partial chunk or span two pieces (gate rows and up rows), each landing in its own columns."""
    from ckptconv.engine import slabs

    hidden, inter, experts = 96, 600, 4  # hidden != intermediate, more experts than top-k
    one_layer_mixtral(tmp_path / "in", hidden, inter, experts, head_dim=12, heads=8, kv_heads=4, seed=tp)
    monkeypatch.setattr(slabs, "WHOLE_GATHER", 0)  # every slab in chunks
    monkeypatch.setattr(slabs, "GATHER_CHUNK", 1)  # of the 64-row floor
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(tmp_path / "in", tmp_path / "nxd", tp=tp, options=options)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)
    _equal_torch(tmp_path / "in", tmp_path, tp=tp, inter=inter, experts=experts)

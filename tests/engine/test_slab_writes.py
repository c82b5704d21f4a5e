"""Expert slabs are built where their O_DIRECT write sends them from: at their file offset's page phase, so no expert
byte is copied into an aligned bounce buffer first (io.direct_io counts those), to NxD and back to HF; and the slabs
built by transposing stacked rows (NxD's gate_up_proj from HF gate and up rows, HF's down_proj from every tp rank's
NxD slab), a chunk of rows at a time, equal torch's own slicing and transposing of the HF matrices."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.engine import execute, slabs
from ckptconv.io import direct_io, transpose
from ckptconv.io.nxd_read import load_shard
from tests.conftest import meta_view, warns_no_tokenizer
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
    hidden, inter, experts = 96, 600, 4  # hidden != intermediate, more experts than top-k
    one_layer_mixtral(tmp_path / "in", hidden, inter, experts, head_dim=12, heads=8, kv_heads=4, seed=tp)
    monkeypatch.setattr(slabs, "WHOLE_GATHER", 0)  # every slab in chunks
    monkeypatch.setattr(slabs, "GATHER_CHUNK", 1)  # of the 64-row floor
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(tmp_path / "in", tmp_path / "nxd", tp=tp, options=options)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)
    _equal_torch(tmp_path / "in", tmp_path, tp=tp, inter=inter, experts=experts)


@pytest.fixture(params=["kernel", "torch"])
def lane(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native transpose on, or torch's copy as CKPTCONV_NATIVE=0 sets it."""
    if request.param == "kernel" and transpose._native is None:
        pytest.skip("the native kernel is not built (tests/io/test_transpose.py says why)")
    monkeypatch.setattr(transpose, "_ENABLED", request.param == "kernel")
    return str(request.param)


def test_gathered_chunks_are_budgeted_as_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: str):
    """A band that gathers a slab in chunks (gate_up_proj to NxD, HF's down_proj back) is budgeted what it uses, to
    the alignment the budget adds: its output slab, the chunk of rows read and, only where torch transposes the chunk
    (the native kernel writes it into its columns), a second matrix for its transpose; and it carves no more than
    that. Chunks of 512 KiB, more than the arena's slack: a reservation short of the transpose's matrix shows."""
    hidden, inter, experts = 128, 2048, 2  # fp32: gate_up_proj slabs of 2 MiB at tp 1, in 4 chunks of 1024 rows
    one_layer_mixtral(tmp_path / "in", hidden, inter, experts, head_dim=32)
    chunk = 512 << 10
    monkeypatch.setattr(slabs, "WHOLE_GATHER", 0)
    monkeypatch.setattr(slabs, "GATHER_CHUNK", chunk)
    bands: list[tuple[int, int, int, bool]] = []  # (budgeted, carved, overflows, gathered) of every band
    gathering = threading.local()
    start_band, end_band, read_transposed = execute._Scratch.start_band, execute._Scratch.end_band, slabs._read_transposed

    def start(self: execute._Scratch, nbytes: int) -> None:
        self.budgeted, gathering.on = nbytes, False
        start_band(self, nbytes)

    def end(self: execute._Scratch, keep: int) -> None:
        bands.append((self.budgeted, self.used, self.overflows, gathering.on))
        end_band(self, keep)

    def gather(*args: Any) -> None:
        gathering.on = True
        read_transposed(*args)

    monkeypatch.setattr(execute._Scratch, "start_band", start)
    monkeypatch.setattr(execute._Scratch, "end_band", end)
    monkeypatch.setattr(slabs, "_read_transposed", gather)
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(tmp_path / "in", tmp_path / "nxd", tp=1, options=options)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)
    assert max(overflows for _, _, overflows, _ in bands) == 0
    gathered = [(budgeted, carved) for budgeted, carved, _, on in bands if on]
    assert len(gathered) == 2 * experts  # gate_up_proj there, down_proj back, an expert a band
    chunks = chunk * (1 if lane == "kernel" else 2)
    uses = {hidden * 2 * inter * 4 + chunks, hidden * inter * 4 + chunks}  # gate_up_proj's slab, HF's down_proj
    slack = slabs.PAGE + 4 * slabs.ALIGN  # what the budget adds for placing and aligning the band's buffers
    for budgeted, carved in gathered:
        assert carved <= budgeted and any(0 <= budgeted - use <= slack for use in uses), (budgeted, carved, uses)
    _equal_torch(tmp_path / "in", tmp_path, tp=1, inter=inter, experts=experts)


@pytest.mark.parametrize("tp", [1, 2])
def test_column_cut_expert_bands_are_budgeted_as_carved(mixtral: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        lane: str, tp: int):
    """A band that cuts expert pieces by columns (to-nxd: every tp rank's down_proj from an expert's HF down_proj;
    to-hf: an expert's HF gate and up from every tp rank's NxD gate_up_proj slab) is budgeted what it carves, here
    from the shapes: its outputs and source matrices and, only where torch transposes a piece that is not a compact
    matrix of its source (the native kernel takes strided rows as they are; tp 1's down_proj is its whole matrix),
    a compacted copy of the largest piece; never less than it carves. Pieces of 1-2 MiB, past the arena's slack: a
    reservation cut short shows as an overflow and as bytes carved past the budget."""
    bands: list[tuple[str, int, int, int]] = []  # (a tensor of the band, budgeted, carved, overflows)
    band = threading.local()
    start_band, end_band, slab_writes = execute._Scratch.start_band, execute._Scratch.end_band, execute.slab_writes

    def start(self: execute._Scratch, nbytes: int) -> None:
        self.budgeted, band.key = nbytes, ""
        start_band(self, nbytes)

    def end(self: execute._Scratch, keep: int) -> None:
        bands.append((band.key, self.budgeted, self.used, self.overflows))
        end_band(self, keep)

    def writes(work: Any, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
        band.key = tensors[0].key
        return slab_writes(work, tensors, *args, **kwargs)

    monkeypatch.setattr(execute._Scratch, "start_band", start)
    monkeypatch.setattr(execute._Scratch, "end_band", end)
    monkeypatch.setattr(execute, "slab_writes", writes)
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(mixtral, tmp_path / "nxd", tp=tp, options=options)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)

    piece = I // tp * H * 4  # fp32: a tp rank's columns of an expert's down_proj, its rows of gate (or of up)
    torch_scratch = lane == "torch"
    uses = {  # outputs + source matrices + a compacted piece where torch transposes a strided one
        NXD_DOWN: tp * piece + H * I * 4 + (piece if torch_scratch and tp > 1 else 0),
        ".w1.weight": 2 * I * H * 4 + 2 * I * H * 4 + (piece if torch_scratch else 0),  # gate and up, tp slabs
    }
    slack = 2 * slabs.PAGE + 5 * slabs.ALIGN  # what the budget adds for placing and aligning (two outputs a band)
    for name, use in uses.items():
        seen = [(budgeted, carved, overflows) for key, budgeted, carved, overflows in bands if name in key]
        assert len(seen) == E, (name, bands)
        for budgeted, carved, overflows in seen:
            assert overflows == 0 and use <= carved <= budgeted, (name, use, budgeted, carved, overflows)
            assert budgeted - use <= slack, f"{name}: budgeted {budgeted} bytes for {use} used ({lane}, tp {tp})"
    assert max(overflows for *_, overflows in bands) == 0
    _equal_torch(mixtral, tmp_path, tp=tp, inter=I, experts=E)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5).to(torch.bfloat16).t(),              # a transposed matrix: the kernel's
    lambda: torch.randn(10, 6).to(torch.bfloat16)[::2, ::2],       # stepped both ways: the kernel's dtype, not its layout
    lambda: torch.randn(6, 10)[:, 1:6].t(),                        # columns of a wider fp32 matrix, transposed
], ids=["transposed", "stepped", "column-slice"])
def test_copy_scratch_budgets_what_copy_compact_asks(make, native: bool, monkeypatch: pytest.MonkeyPatch):
    """The scratch copy_scratch budgets for a pair (seen as meta views, as a band's budget sees it) is what
    copy_compact takes from it: nothing past a matrix's size (an overflow: memory outside the budget), also for a
    pair of the kernel's dtype in a layout it does not take; and the copy is torch's."""
    if native and transpose._native is None:
        pytest.skip("the native kernel is not built (tests/io/test_transpose.py says why)")
    monkeypatch.setattr(transpose, "_ENABLED", native)
    src = make()
    target = torch.empty(tuple(src.shape), dtype=src.dtype)
    sizes = (0, *slabs.copy_scratch(meta_view(target), meta_view(src)))
    asked: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def get(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        asked.append((dtype, tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    slabs.copy_compact(target, src, slabs.Scratch3(get, [], 0, None, [], sizes))  # type: ignore[arg-type]
    assert torch.equal(target, src)
    assert all(dtype == torch.uint8 and shape[0] in sizes for dtype, shape in asked), (sizes, asked)
    if native and src.dtype == torch.bfloat16 and src.stride(0) == 1:
        assert sizes == (0, 0, 0) and not asked  # the kernel transposes in place: no scratch


@pytest.mark.parametrize("shape", [(2, 7168, 4096), (2, 4096, 14336), (2, 14336, 4096), (1, 4096, 7168)])
def test_gathered_chunks_are_whole_tiles_of_the_kernel(shape: tuple[int, ...]):
    """A slab gathered in chunks (Mixtral's, over WHOLE_GATHER) takes whole 16-row tiles of the native kernel at a
    time, at most GATHER_CHUNK bytes of stored rows: 2 MiB of 7168-element rows is 146 rows, cut to 144."""
    from types import SimpleNamespace

    tensor = SimpleNamespace(shape=shape, slabs=shape[0], dtype=torch.bfloat16)
    rows = slabs._chunk_rows(tensor)  # type: ignore[arg-type]
    assert rows % transpose.TILE_ROWS == 0 and 64 <= rows < shape[2]
    assert rows * shape[1] * 2 <= slabs.GATHER_CHUNK < (rows + transpose.TILE_ROWS) * shape[1] * 2
    assert [transpose.whole_tiles(n) for n in (292, 146, 64, 16, 15, 1)] == [288, 144, 64, 16, 15, 1]

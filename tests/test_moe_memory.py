"""MoE conversions within --max-memory (issue 29's bench row): every byte a stacked expert band reads or builds comes
from the band's budgeted arena, and each expert's source matrix is read once, not once per tp rank. Counted in the
executor (bytes, not RSS), so deterministic."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.core.plan import Source
from ckptconv.engine import execute
from ckptconv.io.hf import HfCheckpoint
from ckptconv.io.nxd_read import NxdCheckpoint, load_shard
from tests.conftest import warns_no_tokenizer
from tests.moe_tags import one_layer_mixtral

H, I, E = 8, 12, 4  # noqa: E741  hidden != expert intermediate: a transposed expert would not fit


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixtral")
    one_layer_mixtral(out, H, I, E, head_dim=4)
    return out


def _itemsize(model: Path) -> int:
    return load_file(model / "model.safetensors")["model.layers.0.block_sparse_moe.experts.0.w1.weight"].element_size()


class _Ledger:
    """What the worker threads read during bands: bytes per source key, and reads that landed outside the band's
    arena (fresh memory the budget does not count)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.outside: list[str] = []
        self.in_band = threading.local()
        self.budgets: list[int] = []
        self.overflows: list[int] = []


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> _Ledger:
    book = _Ledger()
    start_band, end_band = execute._Scratch.start_band, execute._Scratch.end_band

    def start(self: execute._Scratch, nbytes: int) -> None:
        start_band(self, nbytes)
        book.in_band.on = True
        with book.lock:
            book.budgets.append(nbytes)

    def end(self: execute._Scratch, keep: int) -> None:
        book.in_band.on = False
        with book.lock:
            book.overflows.append(self.overflows)
        end_band(self, keep)

    def counted(read_rows):  # type: ignore[no-untyped-def]
        def read(reader, source: Source, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
            result = read_rows(reader, source, lo, hi, out)
            if getattr(book.in_band, "on", False):
                arena = execute._SCRATCH.arena
                inside = out is not None and arena.data_ptr() <= result.data_ptr() < arena.data_ptr() + arena.numel()
                with book.lock:
                    book.bytes[source.key] = book.bytes.get(source.key, 0) + result.numel() * result.element_size()
                    if not inside:
                        book.outside.append(f"{source.key}[{lo}:{hi}]")
            return result
        return read

    monkeypatch.setattr(execute._Scratch, "start_band", start)
    monkeypatch.setattr(execute._Scratch, "end_band", end)
    monkeypatch.setattr(HfCheckpoint, "read_rows", counted(HfCheckpoint.read_rows))
    monkeypatch.setattr(NxdCheckpoint, "read_rows", counted(NxdCheckpoint.read_rows))
    return book


def test_to_nxd_reads_each_expert_once_into_the_budget(mixtral: Path, tmp_path: Path, ledger: _Ledger):
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(mixtral, tmp_path / "nxd", tp=2, ep=2, options=options)
    experts = {k: v for k, v in ledger.bytes.items() if ".experts." in k}
    assert len(experts) == 3 * E
    itemsize = _itemsize(mixtral)
    assert experts == dict.fromkeys(experts, H * I * itemsize), "an expert matrix read more (or less) than once"
    assert ledger.outside == [], "reads outside the band's budgeted arena"
    assert max(ledger.overflows) == 0, "a band's buffers exceeded what it was budgeted"


def test_reshard_across_ep_stays_in_the_budget(mixtral: Path, tmp_path: Path, ledger: _Ledger):
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(mixtral, tmp_path / "a", tp=2, ep=2, options=options)
    ledger.bytes.clear()
    ledger.outside.clear()
    ckptconv.reshard(tmp_path / "a", tmp_path / "b", tp=1, ep=4, options=options)
    stacked = {k: v for k, v in ledger.bytes.items() if "expert_mlps" in k}
    # two tensors (gate_up, down) per (ep, tp) source file, each of E/ep experts' slabs read once
    assert sum(stacked.values()) == 3 * E * H * I * _itemsize(mixtral)
    assert ledger.outside == [] and max(ledger.overflows) == 0


def test_cast_experts_equal_the_hf_matrices_transposed(mixtral: Path, tmp_path: Path):
    """--dtype bf16 of fp32 experts: the cast and the transpose meet in the slab builder's scratch matrices;
    every shard's experts equal HF's matrices sliced, transposed and cast by torch directly."""
    ckptconv.to_nxd(mixtral, tmp_path / "nxd", tp=2, ep=2, dtype="bf16",
                    options=ckptconv.RunOptions(quiet=True, workers=2))
    hf = load_file(mixtral / "model.safetensors")
    assert hf["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float32
    w = "model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
    half = I // 2
    for ep in range(2):
        for tp in range(2):
            shard = load_shard(tmp_path / "nxd" / "model" / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_00.pt")
            for local in range(E // 2):
                e = ep * E // 2 + local
                rows = slice(tp * half, (tp + 1) * half)
                gate_up = torch.cat([hf[w.format(e=e, w="w1")][rows], hf[w.format(e=e, w="w3")][rows]]).t()
                down = hf[w.format(e=e, w="w2")][:, rows].t()
                assert torch.equal(shard["model.layers.0." + NXD_GATE_UP][local], gate_up.to(torch.bfloat16))
                assert torch.equal(shard["model.layers.0." + NXD_DOWN][local], down.to(torch.bfloat16))


def test_to_hf_reads_each_expert_slab_once(mixtral: Path, tmp_path: Path, ledger: _Ledger):
    """An expert's HF gate and up come from the same NxD gate_up_proj slabs: read once for both."""
    options = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(mixtral, tmp_path / "nxd", tp=2, ep=2, options=options)
    ledger.bytes.clear()
    ledger.outside.clear()
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=options)
    size = H * I * _itemsize(mixtral)
    assert ledger.bytes["model.layers.0." + NXD_GATE_UP] == 2 * E * size
    assert ledger.bytes["model.layers.0." + NXD_DOWN] == E * size
    assert ledger.outside == [] and max(ledger.overflows) == 0
    back, source = load_file(tmp_path / "hf" / "model.safetensors"), load_file(mixtral / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


# Issue 47: an expert matrix larger than a worker's share of --max-memory. Bands are then parts of slabs; every band
# is budgeted within the share (a band over it is what the test fails on), builds nothing outside its arena, and the
# bytes written are those of an unconstrained run (itself checked against HF's tensors above and in test_moe.py).
BIG_H, BIG_I = 256, 1536  # fp32: 1.5 MiB an expert matrix; --max-memory 4 MiB at 1 worker: a 2 MiB share a band
SMALL = ckptconv.RunOptions(quiet=True, workers=1, max_memory=4 << 20)
SHARE = 2 << 20


def _big_mixtral(out: Path, fused: bool) -> Path:
    model = one_layer_mixtral(out, BIG_H, BIG_I, E, head_dim=64)
    if fused:  # transformers' in-memory names: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
        (out / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
        assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    return out


@pytest.fixture(scope="module")
def big_mixtral(tmp_path_factory) -> Path:
    return _big_mixtral(tmp_path_factory.mktemp("big-mixtral"), fused=False)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file() and p.name != "ckptconv.json")
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != "ckptconv.json")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _within_share(ledger: _Ledger) -> None:
    assert max(ledger.budgets) <= SHARE, f"a band budgeted {max(ledger.budgets)} bytes, past the {SHARE}-byte share"
    assert ledger.outside == [] and max(ledger.overflows) == 0, "a band's buffers outside what it was budgeted"


def test_bands_of_experts_larger_than_the_share_keep_to_it(big_mixtral: Path, tmp_path: Path, ledger: _Ledger):
    """to-nxd, reshard across tp and ep, and to-hf, each at 4 MiB: every band within its 2 MiB share (an expert's
    down_proj group, of both tp ranks, took 5.25 MiB), the same bytes as at the default budget."""
    wide = ckptconv.RunOptions(quiet=True, workers=2)
    ckptconv.to_nxd(big_mixtral, tmp_path / "nxd", tp=2, ep=2, options=SMALL)
    _within_share(ledger)
    ckptconv.to_nxd(big_mixtral, tmp_path / "nxd-wide", tp=2, ep=2, options=wide)
    _same_files(tmp_path / "nxd", tmp_path / "nxd-wide")

    ledger.budgets.clear()
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "ep4", tp=1, ep=4, options=SMALL)
    _within_share(ledger)
    ckptconv.reshard(tmp_path / "nxd-wide", tmp_path / "ep4-wide", tp=1, ep=4, options=wide)
    _same_files(tmp_path / "ep4", tmp_path / "ep4-wide")

    ledger.budgets.clear()
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "ep4", tmp_path / "hf", options=SMALL)
    _within_share(ledger)
    back, source = load_file(tmp_path / "hf" / "model.safetensors"), load_file(big_mixtral / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


def test_training_tag_reshard_keeps_experts_state_to_the_share(big_mixtral: Path, tmp_path: Path, ledger: _Ledger):
    """reshard of a training tag (the AdamW moments and fp32 masters with the weights) tp 2 x ep 2 -> tp 1 x ep 2 at
    4 MiB: every band within its 2 MiB share (an expert's state was read a whole slab at a time, three 1.5 MiB
    matrices of scratch and more), each expert's state equal to its HF weight's, gathered by hand, the weights HF's;
    the same bytes at the default budget (whole slabs)."""
    from tests.moe_tags import expected_expert, expert_in_tag, write_tag

    write_tag(big_mixtral, tmp_path / "tag", tp=2, ep=2)
    ledger.budgets.clear()
    ckptconv.reshard(tmp_path / "tag", tmp_path / "tp1", tp=1, ep=2, options=SMALL)
    _within_share(ledger)
    for expert in range(E):
        for component in ("exp_avg", "exp_avg_sq", "master"):
            got = expert_in_tag(tmp_path / "tp1", 0, expert, component, experts=E, inter=BIG_I)
            want = expected_expert(big_mixtral, "mixtral", 0, expert, component)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (expert, component)
    hf = load_file(big_mixtral / "model.safetensors")
    w = "model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
    for ep in range(2):  # the weights: each tp 2 rank's down_proj rows read straight into the tp 1 slab's
        shard = load_shard(tmp_path / "tp1" / "model" / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_00_pp_rank_00.pt")
        for local in range(E // 2):
            e = ep * E // 2 + local
            gate_up = torch.cat([hf[w.format(e=e, w="w1")], hf[w.format(e=e, w="w3")]]).t()
            assert torch.equal(shard["model.layers.0." + NXD_GATE_UP][local], gate_up)
            assert torch.equal(shard["model.layers.0." + NXD_DOWN][local], hf[w.format(e=e, w="w2")].t())
    ckptconv.reshard(tmp_path / "tag", tmp_path / "tp1-wide", tp=1, ep=2,
                     options=ckptconv.RunOptions(quiet=True, workers=2))
    _same_files(tmp_path / "tp1", tmp_path / "tp1-wide")


def test_fused_hf_input_reads_only_its_rows_into_the_budget(big_mixtral: Path, tmp_path: Path, ledger: _Ledger,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A fused checkpoint (experts.gate_up_proj [E, 2I, H]): each expert's gate and up rows read once, into the
    band's arena (the whole fused slab was read per piece, in fresh memory), within the share at 4 MiB, and the
    shards those of per-expert input."""
    from ckptconv.io.safetensors_io import SafetensorsReader

    fused = _big_mixtral(tmp_path / "fused", fused=True)
    loaded: list[int] = []
    load = SafetensorsReader._load

    def counted(self, offset: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if getattr(ledger.in_band, "on", False):
            loaded.append(n)
        return load(self, offset, n, dtype, shape)

    monkeypatch.setattr(SafetensorsReader, "_load", counted)
    ckptconv.to_nxd(fused, tmp_path / "a", tp=2, ep=2, options=ckptconv.RunOptions(quiet=True, workers=2))
    assert loaded == [], "fused expert bytes read into fresh memory, outside the band's budget"
    assert ledger.outside == [] and max(ledger.overflows) == 0
    assert sum(v for k, v in ledger.bytes.items() if ".experts." in k) == 3 * E * BIG_H * BIG_I * 4, \
        "an expert's fused rows read more than once"
    ledger.budgets.clear()
    ckptconv.to_nxd(fused, tmp_path / "b", tp=2, ep=2, options=SMALL)  # parts of slabs: within the share
    _within_share(ledger)
    assert loaded == []
    ckptconv.to_nxd(big_mixtral, tmp_path / "c", tp=2, ep=2, options=SMALL)
    _same_files(tmp_path / "a" / "model", tmp_path / "c" / "model")
    _same_files(tmp_path / "b" / "model", tmp_path / "c" / "model")


def test_dcp_bands_of_experts_larger_than_the_share_keep_to_it(tmp_path: Path, ledger: _Ledger):
    """Qwen3-MoE to TorchTitan's DCP and back, at 4 MiB: every band within the share, the DCP's files those of the
    default budget, and from-dcp --to hf (stacked [E, ...] sources read a part of a slab at a time) equal to HF's."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=BIG_H, intermediate_size=64, moe_intermediate_size=BIG_I,
                                         num_experts=E, num_experts_per_tok=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, vocab_size=32, num_hidden_layers=1,
                                         norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    ckptconv.to_dcp(tmp_path / "hf", tmp_path / "dcp", options=SMALL)
    _within_share(ledger)
    ckptconv.to_dcp(tmp_path / "hf", tmp_path / "dcp-wide", options=ckptconv.RunOptions(quiet=True, workers=2))
    _same_files(tmp_path / "dcp", tmp_path / "dcp-wide")
    ledger.budgets.clear()
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", to="hf", options=SMALL)
    _within_share(ledger)
    back, source = load_file(tmp_path / "back" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


def test_cast_parts_equal_whole_slabs(big_mixtral: Path, tmp_path: Path, ledger: _Ledger):
    """--dtype bf16 of fp32 experts cut into parts: the cast meets the transposes in each part's scratch; the shards
    equal those built a whole slab at a time."""
    ckptconv.to_nxd(big_mixtral, tmp_path / "a", tp=2, ep=2, dtype="bf16", options=SMALL)
    _within_share(ledger)
    ckptconv.to_nxd(big_mixtral, tmp_path / "b", tp=2, ep=2, dtype="bf16",
                    options=ckptconv.RunOptions(quiet=True, workers=2))
    _same_files(tmp_path / "a" / "model", tmp_path / "b" / "model")


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
def test_parts_are_budgeted_as_used(big_mixtral: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool):
    """Parts of slabs (to-nxd tp 2 and to-hf, cast to bf16 and not, at 4 MiB) are budgeted what they use: their
    outputs' part and source chunks and, of the three scratch matrices, only those its copies take, each at the most
    they take (measured here: the most bytes asked of each), with the native kernel and with torch's transposes
    (which compact the operands, or transpose a chunk at once); never less (no overflow, nothing past the budget)."""
    from ckptconv.engine import slabs
    from ckptconv.io import transpose

    if native and transpose._native is None:
        pytest.skip("the native kernel is not built (tests/io/test_transpose.py says why)")
    monkeypatch.setattr(transpose, "_ENABLED", native)
    bands: list[tuple[int, int, int, int, int]] = []  # (budgeted, carved, scratch carved, scratch asked, overflows)
    band = threading.local()
    start_band, end_band, buffer = execute._Scratch.start_band, execute._Scratch.end_band, slabs.Scratch3._buffer

    def start(self: execute._Scratch, nbytes: int) -> None:
        band.budgeted, band.carved, band.asked = nbytes, 0, [0, 0, 0]
        start_band(self, nbytes)

    def end(self: execute._Scratch, keep: int) -> None:
        if any(band.asked):
            bands.append((band.budgeted, self.used, band.carved, sum(band.asked), self.overflows))
        end_band(self, keep)

    def asked(self: slabs.Scratch3, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        used = execute._SCRATCH.used
        out = buffer(self, index, dtype, shape)
        band.carved += execute._SCRATCH.used - used  # what the scratch matrices took of the arena
        band.asked[index] = max(band.asked[index], out.numel() * out.element_size())
        return out

    monkeypatch.setattr(execute._Scratch, "start_band", start)
    monkeypatch.setattr(execute._Scratch, "end_band", end)
    monkeypatch.setattr(slabs.Scratch3, "_buffer", asked)
    for dtype in ("keep", "bf16"):
        ckptconv.to_nxd(big_mixtral, tmp_path / f"nxd-{dtype}", tp=2, ep=2, dtype=dtype, options=SMALL)
        with warns_no_tokenizer():
            ckptconv.to_hf(tmp_path / "nxd-keep", tmp_path / f"hf-{dtype}", dtype=dtype, options=SMALL)
    assert len(bands) >= 4 * E, bands  # parts of every direction and dtype went through scratch
    slack = 2 * slabs.PAGE + 8 * slabs.ALIGN  # what the budget adds for placing and aligning (two outputs a part)
    for budgeted, carved, scratch, asked, overflows in bands:
        use = carved - scratch + asked
        assert overflows == 0 and carved <= budgeted <= SHARE, (budgeted, carved, overflows)
        assert budgeted - use <= slack, f"a part budgeted {budgeted} bytes for {use} used"
    back, source = load_file(tmp_path / "hf-keep" / "model.safetensors"), load_file(big_mixtral / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


def test_a_slab_that_fits_is_one_part_when_its_chunks_save_memory(big_mixtral: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, ledger: _Ledger):
    """At a 8 MiB share (chunks of 256 KiB) an expert's down_proj group of both tp ranks fits whole (its 1.5 MiB
    source matrix and two 0.75 MiB slabs) but is built as one part, its source read in chunks: budgeted under the
    whole band less half its source matrix, each byte of the expert read once, the same files as whole bands."""
    works: list[tuple[str, Any]] = []
    slab_work = execute.slab_work

    def planned(tensors: list[Any], reader: Any, share: int) -> Any:
        work = slab_work(tensors, reader, share)
        works.append((tensors[0].key, work))
        return work

    monkeypatch.setattr(execute, "slab_work", planned)
    ckptconv.to_nxd(big_mixtral, tmp_path / "part", tp=2, ep=2,
                    options=ckptconv.RunOptions(quiet=True, workers=1, max_memory=16 << 20))
    down = [work for key, work in works if key.endswith(NXD_DOWN)]
    assert down and all(w.bands.nbytes <= 8 << 20 for w in down)
    matrix = BIG_H * BIG_I * 4
    for work in down:
        assert work.parts is not None and work.parts.count == 1, "a whole band where one part took less"
        assert work.parts.nbytes <= work.bands.nbytes - matrix // 2
    assert ledger.outside == [] and max(ledger.overflows) == 0
    experts = {k: v for k, v in ledger.bytes.items() if ".experts." in k}
    assert experts == dict.fromkeys(experts, matrix) and len(experts) == 3 * E, "an expert read more than once"
    ckptconv.to_nxd(big_mixtral, tmp_path / "whole", tp=2, ep=2, options=ckptconv.RunOptions(quiet=True, workers=2))
    _same_files(tmp_path / "part", tmp_path / "whole")

"""MoE conversions within --max-memory (issue 29's bench row): every byte a stacked expert band reads or builds comes
from the band's budgeted arena, and each expert's source matrix is read once, not once per tp rank. Counted in the
executor (bytes, not RSS), so deterministic."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.core.plan import Source
from ckptconv.engine import execute
from ckptconv.io.hf import HfCheckpoint
from ckptconv.io.nxd_read import NxdCheckpoint, load_shard
from tests.conftest import warns_no_tokenizer

H, I, E = 8, 12, 4  # noqa: E741  hidden != expert intermediate: a transposed expert would not fit


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    import transformers

    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=32,
                                        num_hidden_layers=1)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mixtral")
    transformers.MixtralForCausalLM(config).save_pretrained(out)
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

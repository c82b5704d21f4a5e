"""HF -> NxD -> HF is bit-exact over the conversion matrix; exports load in transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.commands.verify import verify
from tests.conftest import hf_state, warns_no_tokenizer

GQA = dict(heads=8, kv_heads=2, head_dim=8, layers=6)
MHA = dict(heads=8, kv_heads=8, head_dim=8, layers=4)


@dataclass(frozen=True)
class Case:
    tp: int
    pp: int
    attention: str
    fuse: bool = False
    hw: str = "trn1"
    vpp: int = 1
    flavour: str = "plain"
    model: str = "gqa"

    @property
    def kvm(self) -> int:
        kv = MHA["kv_heads"] if self.model.startswith("mha") else GQA["kv_heads"]
        return max(1, self.tp // kv) if self.attention == "qkv_linear" else 1

    def __str__(self) -> str:
        fused = "-fused" if self.fuse else ""
        return f"{self.model}-tp{self.tp}-pp{self.pp}-vpp{self.vpp}-kvm{self.kvm}-{self.attention}{fused}-{self.hw}-{self.flavour}"


def matrix() -> list[Case]:
    cases = []
    flavours = ("plain", "xser-inline", "xser-split")
    models = ("gqa", "gqa-tied", "gqa-sharded", "gqa-bf16")
    i = 0
    for tp in (1, 2, 4, 8):
        for attention, fuse in (("separate", False), ("qkv_linear", False), ("qkv_linear", True)):
            for hw in ("trn1", "trn2"):
                if attention == "separate" and hw == "trn2":
                    continue  # hw changes only the qkv_linear head order
                pp, vpp = ((1, 1), (2, 1), (3, 1), (2, 2))[i % 4]
                # separate q/k/v needs whole K/V heads per rank: GQA (2 KV heads) up to tp 2, MHA beyond
                model = "mha" if attention == "separate" and tp > 2 else models[i % 4]
                cases.append(Case(tp, pp, attention, fuse, hw, vpp, flavours[i % 3], model))
                i += 1
    for tp, pp in ((1, 1), (2, 2), (8, 3)):
        cases.append(Case(tp, pp, "coalesced", model="mha", flavour=flavours[tp % 3]))
    cases.append(Case(4, 1, "qkv_linear", True, "trn1", model="mha"))  # MHA on the qkv_linear path (tp <= kv)
    return cases


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, Path]:
    return {
        "gqa": tiny_models("gqa", **GQA),
        "gqa-tied": tiny_models("gqa-tied", tied=True, **GQA),
        "gqa-sharded": tiny_models("gqa-sharded", max_shard_size="40KB", **GQA),
        "gqa-bf16": tiny_models("gqa-bf16", dtype=torch.bfloat16, **GQA),
        "mha": tiny_models("mha", **MHA),
    }


QUIET = ckptconv.RunOptions(quiet=True, workers=2)


def assert_same_state(back: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert list(sorted(back)) == list(sorted(original))
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype, key
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("case", matrix(), ids=str)
def test_round_trip_is_bit_exact(models: dict[str, Path], tmp_path: Path, case: Case):
    src = models[case.model]
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=case.tp, pp=case.pp, vpp=case.vpp, kv_size_multiplier=case.kvm,
                    attention=case.attention, fuse_qkv=case.fuse, hw_backend=case.hw, flavour=case.flavour, options=QUIET)
    shards = sorted((tmp_path / "nxd" / "model").glob("dp_rank_00_tp_rank_*_pp_rank_??.pt"))
    assert len(shards) == case.tp * case.pp
    for shard in shards:
        tensors_dir = Path(f"{shard}.tensors")
        assert tensors_dir.is_dir() == (case.flavour != "plain")
        assert Path(f"{shard}.info.pt").is_file() == (case.flavour == "xser-split")
        assert any(tensors_dir.glob("tensor_*.pt")) == (case.flavour == "xser-split")
    report = verify(src, tmp_path / "nxd")
    assert report["ok"], report["problems"]
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back", options=QUIET)
    original = hf_state(src)
    assert_same_state(hf_state(tmp_path / "back"), original)
    config_in = json.loads((src / "config.json").read_text())
    config_out = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in config_out.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in config_in.items() if k not in ("dtype", "torch_dtype")
    }


@pytest.mark.parametrize("name", ["gqa", "gqa-tied", "gqa-bf16"])
def test_export_loads_in_transformers_with_identical_logits(models: dict[str, Path], tmp_path: Path, name: str):
    from transformers import AutoModelForCausalLM

    ckptconv.to_nxd(models[name], tmp_path / "nxd", tp=4, pp=2, attention="qkv_linear", kv_size_multiplier=2,
                    fuse_qkv=True, hw_backend="trn2", options=QUIET)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back", max_shard_size=60_000, options=QUIET)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(models[name]).eval()(ids).logits
        actual = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(actual, expected)


def test_single_file_inputs_with_config(models: dict[str, Path], tmp_path: Path):
    """A lone model.safetensors, and a merged torch.save state dict, as the official tool takes."""
    src = models["gqa"]
    single = tmp_path / "weights.safetensors"
    single.symlink_to(src / "model.safetensors")
    merged = tmp_path / "merged.pt"
    torch.save(hf_state(src), merged)
    for i, path in enumerate((single, merged)):
        out = tmp_path / f"nxd{i}"
        ckptconv.to_nxd(path, out, tp=2, attention="qkv_linear", config=src / "config.json", options=QUIET)
        with warns_no_tokenizer():
            ckptconv.to_hf(out, tmp_path / f"back{i}", options=QUIET)
        assert_same_state(hf_state(tmp_path / f"back{i}"), hf_state(src))


def test_dtype_cast_then_round_trip(models: dict[str, Path], tmp_path: Path):
    ckptconv.to_nxd(models["gqa"], tmp_path / "nxd", tp=2, attention="qkv_linear", dtype="bf16", options=QUIET)
    shard = torch.load(tmp_path / "nxd" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert {t.dtype for t in shard.values()} == {torch.bfloat16}
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back", options=QUIET)
    expected = {k: v.to(torch.bfloat16) for k, v in hf_state(models["gqa"]).items()}
    assert_same_state(hf_state(tmp_path / "back"), expected)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_output_is_identical_across_workers_and_io_modes(models: dict[str, Path], tmp_path: Path):
    digests = []
    for i, (workers, io, memory) in enumerate(((1, "read", 2**30), (2, "mmap", 2**30), (2, "read", 2**20))):
        out = tmp_path / f"nxd{i}"
        ckptconv.to_nxd(models["gqa"], out, tp=4, pp=2, attention="qkv_linear", kv_size_multiplier=2, fuse_qkv=True,
                        options=ckptconv.RunOptions(workers=workers, io=io, max_memory=memory, quiet=True))
        digests.append(json.loads((out / "ckptconv.json").read_text())["files"])
    assert digests[0] == digests[1] == digests[2]

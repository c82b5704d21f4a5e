"""Mixtral and Qwen3-MoE (issue 29): experts in NxD's layout over tp x ep x pp, bit-exact round trips, both HF
on-disk forms, NxD's file names and module shapes, reshard across ep, and the official converter's shape defect."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP, NXD_ROUTER
from ckptconv.core.layout import ParallelLayout
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import load_shard
from tests.conftest import warns_no_tokenizer

QUIET = ckptconv.RunOptions(quiet=True, workers=2)
H, I, E, TOP_K = 8, 12, 4, 2  # noqa: E741 (NxD and the issue name them so)  hidden != expert intermediate, 4 experts top-2, GQA (4 heads, 2 KV heads)
LAYOUTS = {
    "tp2-ep2-pp2-fused": dict(tp=2, ep=2, pp=2, attention="qkv_linear", fuse_qkv=True),
    "tp4-ep2-kvm2-trn1": dict(tp=4, ep=2, attention="qkv_linear", kv_size_multiplier=2),
    "tp4-ep2-kvm2-trn2": dict(tp=4, ep=2, attention="qkv_linear", kv_size_multiplier=2, hw_backend="trn2"),
    "ep4": dict(ep=4),
}


def _config(family: str):
    import transformers

    common = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=32,
                  num_experts_per_tok=TOP_K)
    if family == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=I, num_local_experts=E, num_hidden_layers=2, **common)
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        intermediate_size=16, moe_intermediate_size=I, num_experts=E, num_hidden_layers=3, mlp_only_layers=[1],
        norm_topk_prob=True, **common)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    made: dict[tuple[str, bool], Path] = {}

    def make(family: str, fused: bool = False) -> Path:
        if (family, fused) not in made:
            cls, config = _config(family)
            torch.manual_seed(1)
            model = cls(config)
            out = tmp_path_factory.mktemp(f"{family}-{'fused' if fused else 'per-expert'}")
            model.save_pretrained(out)
            if fused:  # transformers' in-memory names: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
                os.remove(out / "model.safetensors")
                save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
            made[(family, fused)] = out
        return made[(family, fused)]

    return make


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_round_trip_is_bit_exact(moe_model, tmp_path: Path, family: str, layout: str):
    src = moe_model(family)
    ckptconv.to_nxd(src, tmp_path / "nxd", options=QUIET, **LAYOUTS[layout])
    with warns_no_tokenizer():  # the tiny model has no tokenizer files
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=QUIET)
    before, after = _state(src), _state(tmp_path / "hf")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_hf_input_gives_the_same_shards(moe_model, tmp_path: Path, family: str):
    layout = LAYOUTS["tp2-ep2-pp2-fused"]
    ckptconv.to_nxd(moe_model(family), tmp_path / "a", options=QUIET, **layout)
    ckptconv.to_nxd(moe_model(family, fused=True), tmp_path / "b", options=QUIET, **layout)
    names = sorted(os.listdir(tmp_path / "a" / "model"))
    assert names == sorted(os.listdir(tmp_path / "b" / "model"))
    for name in names:
        a, b = (load_shard(tmp_path / d / "model" / name) for d in ("a", "b"))
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), name


def test_shard_names_shapes_and_expert_slices_are_nxds(moe_model, tmp_path: Path):
    """NxD's ExpertFusedColumnParallelLinear / RowParallelLinear shapes (docs/nxd-format.md, "MoE layers"):
    gate_up [E/ep, H, 2I/tp] with each rank's last dim [gate_r | up_r], down [E/ep, I/tp, H], router [E, H]
    replicated; ep rank r holds experts [r E/ep, (r+1) E/ep); non-expert tensors only in ep_rank_00 files."""
    src = moe_model("mixtral")
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, pp=2, options=QUIET)
    model = tmp_path / "nxd" / "model"
    assert sorted(os.listdir(model)) == sorted(
        f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
        for ep in range(2) for tp in range(2) for pp in range(2))
    hf = _state(src)
    for ep in range(2):
        for tp in range(2):
            shard = load_shard(model / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_00.pt")
            if ep:
                assert set(shard) == {"model.layers.0." + NXD_GATE_UP, "model.layers.0." + NXD_DOWN}
            else:
                assert tuple(shard["model.layers.0." + NXD_ROUTER].shape) == (E, H)
            gate_up, down = shard["model.layers.0." + NXD_GATE_UP], shard["model.layers.0." + NXD_DOWN]
            assert tuple(gate_up.shape) == (E // 2, H, 2 * I // 2) and tuple(down.shape) == (E // 2, I // 2, H)
            rows = slice(tp * I // 2, (tp + 1) * I // 2)
            for local in range(E // 2):
                e = ep * E // 2 + local
                w = f"model.layers.0.block_sparse_moe.experts.{e}."
                assert torch.equal(gate_up[local], torch.cat([hf[w + "w1.weight"][rows], hf[w + "w3.weight"][rows]]).T)
                assert torch.equal(down[local], hf[w + "w2.weight"][:, rows].T)


def _official_shapes(tp: int) -> dict[str, tuple[int, ...]]:
    """The official converter's mapping (NxD examples/training/mixtral/convert_checkpoints.py on
    CheckpointConverterBase): per-expert [out, in] stacked without a transpose, then gate_up split along dim 2
    (gate_up_proj_partition_dim) and down along dim 1 (down_proj_partition_dim): along H, not I."""
    gate = torch.zeros(E, I, H)
    down = torch.zeros(E, H, I)
    gate_r = gate.narrow(2, 0, H // tp)
    gate_up = torch.cat([gate_r, gate_r], dim=2)
    down_r = down.narrow(1, 0, H // tp)
    return {NXD_GATE_UP: tuple(gate_up.shape), NXD_DOWN: tuple(down_r.shape)}


def _nxd_module_shapes(tp: int, ep: int) -> dict[str, tuple[int, ...]]:
    """What NxD's modules hold (moe/experts.py: ExpertFusedColumnParallelLinear(input_size=H, output_size=2I,
    stride=2) weight (E/ep, input_size, output_size/tp); ExpertFusedRowParallelLinear(input_size=I, output_size=H)
    weight (E/ep, input_size/tp, output_size)), from the facts in docs/nxd-format.md."""
    return {NXD_GATE_UP: (E // ep, H, 2 * I // tp), NXD_DOWN: (E // ep, I // tp, H)}


def test_official_mapping_gives_shapes_nxd_refuses_ours_match(moe_model, tmp_path: Path):
    ckptconv.to_nxd(moe_model("mixtral"), tmp_path / "nxd", tp=2, options=QUIET)
    ours = load_shard(tmp_path / "nxd" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    expected = _nxd_module_shapes(tp=2, ep=1)
    official = _official_shapes(tp=2)
    for name, shape in expected.items():
        assert tuple(ours["model.layers.0." + name].shape) == shape
        assert official[name] != shape  # (4, 12, 8) and (4, 4, 12) where NxD holds (4, 8, 12) and (4, 6, 8)
    assert official == {NXD_GATE_UP: (4, 12, 8), NXD_DOWN: (4, 4, 12)}


def test_reshard_across_ep_and_tp_is_exact(moe_model, tmp_path: Path):
    src = moe_model("qwen3_moe")
    ckptconv.to_nxd(src, tmp_path / "a", tp=2, ep=2, pp=2, options=QUIET)
    ckptconv.reshard(tmp_path / "a", tmp_path / "b", tp=4, ep=4, pp=1, kv_size_multiplier=2, attention="qkv_linear",
                     options=QUIET)
    assert json.loads((tmp_path / "b" / "ckptconv.json").read_text())["layout"]["ep"] == 4
    ckptconv.reshard(tmp_path / "b", tmp_path / "c", tp=1, ep=1, kv_size_multiplier=1, attention="separate",
                     options=QUIET)
    ckptconv.to_nxd(src, tmp_path / "direct", options=QUIET)
    for name in os.listdir(tmp_path / "direct" / "model"):
        a, b = (load_shard(tmp_path / d / "model" / name) for d in ("direct", "c"))
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen3_moe_dense_layers_keep_the_dense_mlp():
    spec = ModelSpec.from_config(json.loads(json.dumps(_config("qwen3_moe")[1].to_dict())))
    assert [spec.sparse(layer) for layer in range(3)] == [True, False, True]
    assert (spec.experts, spec.expert_intermediate, spec.top_k, spec.dense_mlp_layers) == (E, I, TOP_K, 1)


@pytest.mark.parametrize(("layout", "message"), [
    (ParallelLayout(ep=3), "--ep 3 must divide the number of experts (4)"),
    (ParallelLayout(tp=8), "--tp 8 must divide"),
])
def test_bad_ep_is_refused(layout: ParallelLayout, message: str):
    spec = ModelSpec.from_config(_config("mixtral")[1].to_dict())
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout.check_model(spec)


def test_ep_on_a_dense_model_is_refused():
    spec = ModelSpec.from_config({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
                                  "vocab_size": 8, "num_hidden_layers": 1})
    with pytest.raises(ConversionError, match="has no experts"):
        ParallelLayout(ep=2).check_model(spec)



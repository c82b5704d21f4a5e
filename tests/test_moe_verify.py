"""verify on mixture-of-experts shards (issue 29 item 2): the routed-MLP math against transformers' own sparse
blocks, then rank by rank (each ep rank's experts, each tp rank's I block) against the dense HF block; a swapped
expert is named with the expert it holds, a stack stored untransposed by its shape when the shards are opened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.commands.verify import verify
from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.core.reference import sparse_mlp
from ckptconv.errors import ConversionError
from ckptconv.io.digest import FileRecord
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.nxd_write import save_shard
from tests.conftest import warns_no_tokenizer
from tests.test_moe import QUIET, _config, moe_model  # noqa: F401  (moe_model: the fixture)


@pytest.mark.parametrize(("family", "norm"), [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_sparse_mlp_matches_transformers_block(family: str, norm: bool):
    cls, config = _config(family)
    if family == "qwen3_moe":
        config.norm_topk_prob = norm
    torch.manual_seed(2)
    model = cls(config).eval()
    block = model.model.layers[0].mlp
    fused_up, fused_down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    experts = {e: (*fused_up[e].chunk(2), fused_down[e]) for e in range(fused_up.shape[0])}
    x = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = block(x)
    ours = sparse_mlp(x, block.gate.weight.detach(), experts, config.num_experts_per_tok, normalize=norm,
                      cast_back=family == "qwen3_moe")
    assert torch.allclose(ours, expected, atol=1e-6, rtol=1e-5), (ours - expected).abs().max()
    if family == "qwen3_moe" and not norm:  # the renormalization is what differs: a wrong flag is caught
        wrong = sparse_mlp(x, block.gate.weight.detach(), experts, config.num_experts_per_tok, normalize=True)
        assert not torch.allclose(wrong, expected, atol=1e-4)


def _edit(root: Path, ep: int, tp: int, change) -> None:
    """Rewrite one shard as a buggy converter would have; ckptconv.json records the new bytes, so what is tested
    is verify's numerics, not the checked reads."""
    rel = f"model/dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_00.pt"
    state = load_shard(root / rel)
    change(state)
    save_shard(root / rel, state)
    meta = json.loads((root / "ckptconv.json").read_text())
    algorithm = next(a for a in ("blake3", "sha256") if a in meta["files"][rel])
    meta["files"][rel] = FileRecord.of(root / rel, algorithm).to_json()
    (root / "ckptconv.json").write_text(json.dumps(meta))


def _problems(report: dict) -> str:
    assert report["ok"] is False
    return "\n".join(report["problems"])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_verify_passes_at_tp2_ep2(moe_model, tmp_path: Path, family: str):  # noqa: F811
    src = moe_model(family)
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, options=QUIET)
    report = verify(src, tmp_path / "nxd")
    assert report["ok"], report["problems"]
    assert report["layers"][0]["mlp"]["rel"] < 1e-6


def test_verify_passes_on_fused_hf_and_pp(moe_model, tmp_path: Path):  # noqa: F811
    src = moe_model("qwen3_moe", fused=True)
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, pp=3, options=QUIET)
    report = verify(src, tmp_path / "nxd")
    assert report["ok"], report["problems"]


def test_verify_names_two_swapped_experts(moe_model, tmp_path: Path):  # noqa: F811
    src = moe_model("mixtral")
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, options=QUIET)

    def swap(state):
        for key in (NXD_GATE_UP, NXD_DOWN):
            w = state["model.layers.1." + key]
            state["model.layers.1." + key] = torch.stack([w[1], w[0], *w[2:]])

    _edit(tmp_path / "nxd", 0, 0, swap)
    text = _problems(verify(src, tmp_path / "nxd"))
    assert "layer 1 mlp" in text and "experts 0 and 1 swapped on ep rank 0 tp rank 0" in text, text
    assert "layer 0" not in text and "ep rank 1" not in text


def test_verify_names_a_transposed_expert_stack(moe_model, tmp_path: Path):  # noqa: F811
    src = moe_model("mixtral")
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, options=QUIET)

    def transpose(state):
        key = "model.layers.0." + NXD_DOWN
        state[key] = state[key].transpose(1, 2).contiguous()

    _edit(tmp_path / "nxd", 1, 1, transpose)
    with pytest.raises(ConversionError) as caught:
        verify(src, tmp_path / "nxd")
    assert str(caught.value).endswith(
        "dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt: 'model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight' "
        "has shape [2, 8, 6], layout tp 2 ep 2 pp 1 vpp 1 kvm 1 separate trn1 implies [2, 6, 8]: the experts are "
        "stored transposed (HF's [out, in] stacked instead of NxD's [in, out])"), caught.value


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_to_hf_fused_experts_equal_transformers_state_and_load(moe_model, tmp_path: Path, family: str):  # noqa: F811
    """--hf-experts fused writes transformers' in-memory form: exactly the model's own state_dict (the fused
    fixture), which from_pretrained loads to the same logits as the per-expert source."""
    import transformers
    from safetensors.torch import load_file

    src = moe_model(family)
    ckptconv.to_nxd(src, tmp_path / "nxd", tp=2, ep=2, pp=2, options=QUIET)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", hf_experts="fused", options=QUIET)
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    expected = load_file(moe_model(family, fused=True) / "model.safetensors")
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[k], expected[k]) for k in ours)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    assert torch.equal(a, b)


def test_hf_experts_is_checked(moe_model, tmp_path: Path):  # noqa: F811
    ckptconv.to_nxd(moe_model("mixtral"), tmp_path / "nxd", ep=2, options=QUIET)
    with pytest.raises(ValueError, match="--hf-experts must be one of per-expert, fused, got 'stacked'"):
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", hf_experts="stacked", options=QUIET)

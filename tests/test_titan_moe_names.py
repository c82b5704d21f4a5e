"""Qwen3-MoE into TorchTitan's DCP and back (issue 29), main lane: TorchTitan 0.3.0's names, shapes and order for a
mixture of experts with a dense layer, each expert stacked in HF orientation (checked against the safetensors by hand,
from HF per-expert, HF fused and NxD tp2 x ep2 sources alike), the way back bit-exact to HF and to NxD shards at
tp2 x ep2, a trained routing bias refused unless dropped, and Mixtral refused naming why. TorchTitan's own model
loads these DCPs in the TorchTitan lane (tests/test_titan_moe.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptconv
from ckptconv.cli.main import main as ckptconv_main
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.titan.names import optimizer_params, titan_params
from tests.conftest import hf_state, warns_no_tokenizer
from tests.test_dcp import dcp_load, dcp_save

QUIET = ckptconv.RunOptions(quiet=True)
E = 4
W = "layers.{}.moe.routed_experts.inner_experts."


def make_qwen3_moe(out: Path, *, norm_topk_prob: bool = True, seed: int = 1, fused: bool = False) -> Path:
    """A tiny Qwen3-MoE: hidden 16 != expert intermediate 24 (dense layer 32; multiples of 8, what TorchTitan's CPU
    grouped matmul needs), 4 experts top-2, 4 query heads over 2 KV heads, layer 1 dense (``mlp_only_layers``);
    ``fused``: stored in transformers' in-memory form (experts.gate_up_proj [E, 2I, H], experts.down_proj)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=24, num_experts=E, num_experts_per_tok=2,
        num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        initializer_range=0.2)  # weights large enough that every expert's output shows in the logits
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(out)
    if fused:
        os.remove(out / "model.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    return out


def titan_shapes(hf: Path) -> dict[str, tuple[int, ...]]:
    return {p.key: p.shape for p in titan_params(ModelSpec.from_file(hf / "config.json"))}


def test_the_names_shapes_and_order_are_torchtitans(qwen3_moe_hf):
    """Written out from TorchTitan 0.3.0's Qwen3Model(...).state_dict() of this config (the TorchTitan lane checks
    the whole list against the live model): a sparse layer's moe block in the slot of feed_forward."""
    spec = ModelSpec.from_file(qwen3_moe_hf / "config.json")
    params = {p.key: p.shape for p in titan_params(spec)}
    attention = ["attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight", "attention.qkv_linear.wv.weight",
                 "attention.wo.weight", "attention.q_norm.weight", "attention.k_norm.weight"]
    norms = ["attention_norm.weight", "ffn_norm.weight"]
    sparse = ["moe.expert_bias_E", "moe.routed_experts.inner_experts.w1_EFD", "moe.routed_experts.inner_experts.w2_EDF",
              "moe.routed_experts.inner_experts.w3_EFD", "moe.router.gate.weight"]
    dense = ["feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]
    expected = ["tok_embeddings.weight"]
    for layer, mlp in enumerate([sparse, dense, sparse]):
        expected += [f"layers.{layer}.{n}" for n in attention + mlp + norms]
    assert list(params) == expected + ["norm.weight", "lm_head.weight"]
    assert params["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == (E, 24, 16)  # [E, I, H]
    assert params["layers.0.moe.routed_experts.inner_experts.w2_EDF"] == (E, 16, 24)  # [E, H, I]
    assert params["layers.2.moe.router.gate.weight"] == (E, 16) and params["layers.2.moe.expert_bias_E"] == (E,)
    assert params["layers.1.feed_forward.w1.weight"] == (32, 16)
    trained = optimizer_params(spec)  # the buffer has no optimizer state
    assert "layers.0.moe.expert_bias_E" not in trained and "layers.0.moe.routed_experts.inner_experts.w2_EDF" in trained


def test_decoder_sparse_step_chooses_the_moe_layers_as_qwen3moe_does():
    """Qwen3MoeDecoderLayer routes layer n when n is not in mlp_only_layers and (n + 1) % decoder_sparse_step == 0:
    with step 2 and layer 3 listed, only layer 1 is sparse (names and the generated config's layers)."""
    from ckptconv.titan.config_file import config_module

    spec = ModelSpec.from_config({"model_type": "qwen3_moe", "hidden_size": 16, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
                                  "moe_intermediate_size": 24, "num_experts": E, "num_experts_per_tok": 2,
                                  "vocab_size": 64, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                  "mlp_only_layers": [3], "norm_topk_prob": False})
    keys = [p.key for p in titan_params(spec)]
    assert [n for n in range(4) if f"layers.{n}.moe.router.gate.weight" in keys] == [1]
    assert [n for n in range(4) if f"layers.{n}.feed_forward.w1.weight" in keys] == [0, 2, 3]
    text = config_module(spec, None, what="a test")
    assert "sparse = (1,)" in text and "route_norm = False" in text and "hidden_dim=32" in text


def expected_moe(hf: Path) -> dict[str, torch.Tensor]:
    """Each sparse layer's TorchTitan tensors from the HF per-expert file, by hand."""
    state, out = hf_state(hf), {}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp."
        for key, name in (("w1_EFD", "gate_proj"), ("w2_EDF", "down_proj"), ("w3_EFD", "up_proj")):
            out[W.format(layer) + key] = torch.stack([state[f"{p}experts.{e}.{name}.weight"] for e in range(E)])
        out[f"layers.{layer}.moe.router.gate.weight"] = state[p + "gate.weight"]
        out[f"layers.{layer}.moe.expert_bias_E"] = torch.zeros(E)
    return out


@pytest.mark.parametrize("source", ["hf", "hf-fused", "nxd-tp2-ep2", "nxd-ep4-fused-qkv"])
def test_to_dcp_stacks_each_expert_in_hf_orientation(qwen3_moe_hf, tmp_path, source):
    if source == "hf":
        src = qwen3_moe_hf
    elif source == "hf-fused":
        src = make_qwen3_moe(tmp_path / "fused", fused=True)
    else:
        layout = dict(tp=2, ep=2) if source == "nxd-tp2-ep2" else dict(ep=4, attention="qkv_linear", fuse_qkv=True)
        src = tmp_path / "nxd"
        ckptconv.to_nxd(qwen3_moe_hf, src, options=QUIET, **layout)
    result = ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    notes = [n for n in result.notes if "expert_bias_E" in n]
    assert len(notes) == 1 and "2 sparse layer(s) written as zeros" in notes[0] and "aux loss" in notes[0]
    loaded = dcp_load(tmp_path / "dcp", titan_shapes(qwen3_moe_hf))
    for key, want in expected_moe(qwen3_moe_hf).items():
        assert torch.equal(loaded[key], want), key
    config = (tmp_path / "dcp" / "torchtitan_config.py").read_text()
    assert "_build_qwen3_moe_layers(" in config and "moe_hidden_dim=24, num_experts=4, top_k=2" in config
    assert "sparse = (0, 2)" in config and "route_norm = True" in config


def test_from_dcp_is_bit_exact_to_hf_and_to_nxd_at_tp2_ep2(qwen3_moe_hf, tmp_path):
    ckptconv.to_dcp(qwen3_moe_hf, tmp_path / "dcp", options=QUIET)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "hf", options=QUIET)
    before, after = hf_state(qwen3_moe_hf), hf_state(tmp_path / "hf")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "nxd", to="nxd", tp=2, ep=2, options=QUIET)
    ckptconv.to_nxd(qwen3_moe_hf, tmp_path / "ref", tp=2, ep=2, options=QUIET)
    files = sorted(p.name for p in (tmp_path / "ref" / "model").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "nxd" / "model").iterdir()) and len(files) == 4
    for name in files:
        ours = torch.load(tmp_path / "nxd" / "model" / name, weights_only=True)
        ref = torch.load(tmp_path / "ref" / "model" / name, weights_only=True)
        assert list(ours) == list(ref) and all(torch.equal(ours[k], ref[k]) for k in ref), name
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf2", options=QUIET)
    again = hf_state(tmp_path / "hf2")
    assert all(torch.equal(before[k], again[k]) for k in before)


def test_a_trained_expert_bias_is_refused_unless_dropped(qwen3_moe_hf, tmp_path):
    """TorchTitan's load balancing trains expert_bias_E; HF's Qwen3-MoE has no place for it: from-dcp refuses it in
    one line naming the key, and with --drop-expert-bias writes the weights, saying what it dropped."""
    ckptconv.to_dcp(qwen3_moe_hf, tmp_path / "dcp", options=QUIET)
    state = dcp_load(tmp_path / "dcp", titan_shapes(qwen3_moe_hf))
    state["layers.2.moe.expert_bias_E"] = torch.tensor([0.0, 0.25, -0.5, 0.0])
    dcp_save(state, tmp_path / "trained")
    args = ["from-dcp", str(tmp_path / "trained"), str(tmp_path / "hf"), "--config", str(qwen3_moe_hf / "config.json"),
            "--quiet"]
    assert ckptconv_main(args) == 1
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConversionError, match=r"/trained/.metadata: 'layers.2.moe.expert_bias_E' is not zero \(largest "
                                              r"\|expert_bias_E\| 0.5\): .* pass --drop-expert-bias"):
        ckptconv.from_dcp(tmp_path / "trained", tmp_path / "hf", config=qwen3_moe_hf / "config.json", options=QUIET)
    result = ckptconv.from_dcp(tmp_path / "trained", tmp_path / "hf", config=qwen3_moe_hf / "config.json",
                               drop_expert_bias=True, options=QUIET)
    assert any("dropped the trained expert_bias_E (--drop-expert-bias; largest |value| 0.5)" in n for n in result.notes)
    before, after = hf_state(qwen3_moe_hf), hf_state(tmp_path / "hf")
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a run with TorchTitan's load_balance_coeff None saves no bias at all: nothing to refuse or drop
    dcp_save({k: v for k, v in state.items() if not k.endswith("expert_bias_E")}, tmp_path / "unbalanced")
    result = ckptconv.from_dcp(tmp_path / "unbalanced", tmp_path / "hf2", config=qwen3_moe_hf / "config.json", options=QUIET)
    assert any("no expert_bias_E" in n for n in result.notes)
    again = hf_state(tmp_path / "hf2")
    assert all(torch.equal(before[k], again[k]) for k in before)


def test_mixtral_is_refused_naming_why(qwen3_moe_hf, tmp_path, capsys):
    import transformers

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=E,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=32)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    ckptconv.to_nxd(tmp_path / "hf", tmp_path / "nxd", ep=2, options=QUIET)
    capsys.readouterr()
    for src in ("hf", "nxd"):
        assert ckptconv_main(["to-dcp", str(tmp_path / src), str(tmp_path / "dcp"), "--quiet"]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "ckptconv: error: TorchTitan 0.3.0 has no model for Mixtral (model_type 'mixtral'): there is no Mixtral "
            "model upstream (no TorchTitan module would load or train its block_sparse_moe experts); the families it "
            "has: llama (llama3), qwen3 (qwen3), qwen3_moe (qwen3), deepseek_v3 (deepseek_v3), gpt_oss (gpt_oss)")
        assert not (tmp_path / "dcp").exists()
    ckptconv.to_dcp(qwen3_moe_hf, tmp_path / "qwen-dcp", options=QUIET)
    # nor back, under its config
    with pytest.raises(ConversionError, match=r"TorchTitan 0.3.0 has no model for Mixtral"):
        ckptconv.from_dcp(tmp_path / "qwen-dcp", tmp_path / "back", config=tmp_path / "hf" / "config.json",
                          options=QUIET)


def test_an_ep2_training_tags_adamw_state_lands_on_each_expert_and_comes_back(tmp_path):
    """A hand-written Qwen3-MoE tag at tp2 x ep2 with ZeRO-1 over 4 dp ranks (tests/moe_tags.py: every moment an
    elementwise function of its weight, so each expert's is its own): to-dcp writes TorchTitan's AdamW tensors of the
    stacked experts as the HF experts' moments stacked, no state for expert_bias_E; from-dcp makes an nxdtrain tag at
    tp 1 x ep 4 whose every expert holds its own moments again, exactly."""
    from tests.moe_tags import STEP, expected_expert, expert_in_tag, state_of, tiny_moe, write_tag

    hf = tiny_moe("qwen3_moe", tmp_path / "hf")
    tag = write_tag(hf, tmp_path / "tag", tp=2, ep=2, dp=4, zero1=True)
    spec = ModelSpec.from_file(hf / "config.json")
    result = ckptconv.to_dcp(tag, tmp_path / "dcp", options=QUIET)
    assert any("training tag at step 7: AdamW state" in n for n in result.notes)
    shapes = {p.key: p.shape for p in titan_params(spec)}
    moments = {f"optimizer.state.{p}.{c}": shapes.get(p, ()) if c != "step" else ()
               for p in optimizer_params(spec) for c in ("exp_avg", "exp_avg_sq", "step")}
    state = hf_state(hf)
    loaded = dcp_load(tmp_path / "dcp", {k: v for k, v in moments.items() if "moe." in k})
    assert not any("expert_bias_E" in k for k in moments)  # a buffer: no optimizer state
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp."
        for key, name in (("w1_EFD", "gate_proj"), ("w2_EDF", "down_proj"), ("w3_EFD", "up_proj")):
            for component in ("exp_avg", "exp_avg_sq"):
                want = torch.stack([state_of(state[f"{p}experts.{e}.{name}.weight"])[component] for e in range(E)])
                got = loaded[f"optimizer.state.{W.format(layer)}{key}.{component}"]
                assert torch.equal(got, want), (key, component)
        router = loaded[f"optimizer.state.layers.{layer}.moe.router.gate.weight.exp_avg"]
        assert torch.equal(router, state_of(state[p + "gate.weight"])["exp_avg"])
        assert loaded[f"optimizer.state.{W.format(layer)}w1_EFD.step"].item() == STEP
    back = ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", to="nxd", tp=1, ep=4, options=QUIET)
    assert back.layout["ep"] == 4 and back.layout["tp"] == 1
    for layer in (0, 2):
        for e in range(E):
            for component in ("exp_avg", "exp_avg_sq"):
                ours = expert_in_tag(tmp_path / "back", layer, e, component)
                for got, want in zip(ours, expected_expert(hf, "qwen3_moe", layer, e, component), strict=True):
                    assert torch.equal(got, want), (layer, e, component)

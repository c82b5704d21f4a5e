"""GPT-OSS's layer math (ckptconv/core/reference_gpt_oss.py) against transformers' GptOss modules: YaRN's frequencies
and attention factor, the interleaved clamped SwiGLU, the routed experts with their biases, and whole-model logits
through sink attention on sliding and full layers; a dropped sink, an un-interleaved gate_up or a layer's window
ignored is far outside the agreement."""

from __future__ import annotations

import pytest
import torch

from ckptconv.core.reference import rms_norm
from ckptconv.core.reference_gpt_oss import gpt_oss_layer, gpt_oss_moe, swiglu, yarn_inv_freq
from tests.gpt_oss_models import gpt_oss_model

pytest.importorskip("transformers")

TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def layer_weights(model: torch.nn.Module, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    return {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


def reference_logits(model: torch.nn.Module, tokens: torch.Tensor,
                     edit=lambda layer, w: w) -> torch.Tensor:
    config, state = model.config.to_dict(), model.state_dict()
    x = state["model.embed_tokens.weight"][tokens]
    for n in range(config["num_hidden_layers"]):
        x = gpt_oss_layer(x, edit(n, layer_weights(model, n)), config, n)
    return rms_norm(x, state["model.norm.weight"], config["rms_norm_eps"]) @ state["lm_head.weight"].t()


@pytest.fixture(scope="module")
def model():
    return gpt_oss_model()


def test_yarn_is_transformers(model):
    rotary = model.model.rotary_emb
    inv, factor = yarn_inv_freq(model.config.rope_parameters, 8)
    assert torch.equal(inv, rotary.inv_freq) and factor == rotary.attention_scaling
    plain = yarn_inv_freq({**model.config.rope_parameters, "factor": 1.0}, 8)[0]
    assert not torch.allclose(plain, inv)  # factor 32 moves the low frequencies


def test_the_interleaved_clamped_swiglu_is_transformers(model):
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(5, 48) * 6  # beyond the clamp
    assert torch.equal(swiglu(x, alpha=experts.alpha, limit=experts.limit), experts._apply_gate(x))
    halves = torch.cat([x[..., ::2], x[..., 1::2]], -1)  # gate then up, not interleaved
    assert not torch.allclose(swiglu(halves), experts._apply_gate(x))


def test_the_routed_experts_are_transformers(model):
    h = torch.randn(2, 7, 32)
    with torch.no_grad():
        theirs = model.model.layers[1].mlp(h)[0]
    ours = gpt_oss_moe(h, layer_weights(model, 1), 2)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()


def test_whole_model_logits_are_transformers_and_sinks_windows_interleave_matter(model):
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = reference_logits(model, TOKENS)
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-5 * scale, (ours - theirs).abs().max() / scale

    def no_sinks(n, w):
        return {**w, "self_attn.sinks": torch.full_like(w["self_attn.sinks"], -1e4)}

    def halves(n, w):
        g = w["mlp.experts.gate_up_proj"]
        return {**w, "mlp.experts.gate_up_proj": torch.cat([g[..., ::2], g[..., 1::2]], -1)}

    for edit in (no_sinks, halves):
        assert (reference_logits(model, TOKENS, edit) - theirs).abs().max() > 1e-2 * scale, edit.__name__
    full = model.config.to_dict() | {"layer_types": ["full_attention"] * 3}
    x = model.state_dict()["model.embed_tokens.weight"][TOKENS]
    assert not torch.allclose(gpt_oss_layer(x, layer_weights(model, 0), full, 0),
                              gpt_oss_layer(x, layer_weights(model, 0), model.config.to_dict(), 0), atol=1e-4)

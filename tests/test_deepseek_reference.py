"""DeepSeek-V3's layer math (:mod:`ckptconv.core.reference_mla`) against transformers' ``DeepseekV3`` layers, captured
by forward hooks on a tiny model (tests/deepseek_models.py): attention (both q forms, interleaved and halves RoPE,
YaRN), the biased group-limited router, the MoE block with shared experts, whole decoder layers. And the bugs it
must see: YaRN changes the output, so does the router bias, and a swapped pair of experts."""

from __future__ import annotations

import pytest
import torch

from ckptconv.core.reference_mla import decoder_layer, mla_attention, moe, route_grouped
from tests.deepseek_models import E, build_model

TOL = 1e-5


def captured(model, tokens: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Input and output of every decoder layer, its attention and its MLP (transformers' eager attention)."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for n, layer in enumerate(model.model.layers):
        for name, module in (("layer", layer), ("attn", layer.self_attn), ("mlp", layer.mlp)):
            def hook(mod, args, kwargs, out, key=f"{name}{n}"):
                x = args[0] if args else kwargs["hidden_states"]
                seen[key] = (x.detach(), (out[0] if isinstance(out, tuple) else out).detach())
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return seen


def weights_of(model, n: int) -> dict[str, torch.Tensor]:
    """Layer ``n``'s tensors under the HF checkpoint names (experts per expert, as saved)."""
    prefix = f"model.layers.{n}."
    out = {k[len(prefix):]: v.detach() for k, v in model.state_dict().items() if k.startswith(prefix)}
    if "mlp.experts.gate_up_proj" in out:
        gate_up, down = out.pop("mlp.experts.gate_up_proj"), out.pop("mlp.experts.down_proj")
        i = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :i]
            out[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, i:]
            out[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return out


@pytest.mark.parametrize(("q_lora_rank", "rope_interleave"), [(24, True), (None, True), (24, False)])
def test_layers_match_transformers(q_lora_rank, rope_interleave):
    model = build_model(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave, attn_implementation="eager")
    config = model.config.to_dict()
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    seen = captured(model, tokens)
    for n in range(3):
        w = weights_of(model, n)
        x, out = seen[f"layer{n}"]
        h, attn = seen[f"attn{n}"]
        torch.testing.assert_close(mla_attention(h, w, config), attn, atol=TOL, rtol=0)
        h2, mlp_out = seen[f"mlp{n}"]
        if n:
            torch.testing.assert_close(moe(h2, w, config), mlp_out, atol=TOL, rtol=0)
        torch.testing.assert_close(decoder_layer(x, w, config), out, atol=TOL, rtol=0)


def test_router_matches_transformers_and_uses_its_bias_and_groups():
    model = build_model()
    config, gate = model.config.to_dict(), model.model.layers[1].mlp.gate
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hf_weights, hf_indices = gate(h)
    weights, indices = route_grouped(h, gate.weight, gate.e_score_correction_bias, config)
    order, hf_order = indices.sort(dim=-1), hf_indices.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices),
                               atol=1e-6, rtol=0)
    unbiased = route_grouped(h, gate.weight, torch.zeros(E), config)[1]
    ungrouped = route_grouped(h, gate.weight, gate.e_score_correction_bias, {**config, "n_group": 1, "topk_group": 1})[1]
    assert not torch.equal(unbiased.sort().values, indices.sort().values)  # the bias changes the choice
    assert not torch.equal(ungrouped.sort().values, indices.sort().values)  # so do the groups


def test_yarn_and_a_swapped_expert_change_the_output():
    model = build_model(attn_implementation="eager")
    config = model.config.to_dict()
    tokens = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    seen = captured(model, tokens)
    w = weights_of(model, 1)
    h, attn = seen["attn1"]
    plain = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert (mla_attention(h, w, plain) - attn).abs().max() > 1e-3  # YaRN matters at these positions
    h2, mlp_out = seen["mlp1"]
    swapped = dict(w)
    for part in ("gate_proj", "up_proj", "down_proj"):
        swapped[f"mlp.experts.0.{part}.weight"], swapped[f"mlp.experts.1.{part}.weight"] = (
            w[f"mlp.experts.1.{part}.weight"], w[f"mlp.experts.0.{part}.weight"])
    assert (moe(h2, swapped, config) - mlp_out).abs().max() > 1e-4

"""DeepSeek-V3's layer math in plain torch (the family of :mod:`ckptconv.core.families.deepseek_v3`), step for step as
transformers' ``DeepseekV3`` computes it: YaRN RoPE with its mscale, multi-head latent attention (both q forms,
interleaved or halves RoPE), the sigmoid router with ``e_score_correction_bias`` and group-limited top-k, shared
experts, and the MTP layer's input fusion. The shared pieces (RMSNorm, the gated MLP, the weighted sum over routed
experts, causal attention) are :mod:`ckptconv.core.reference`'s. Tests check each against transformers' layers.

    >>> inv, factor = yarn_inv_freq({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
    ...     "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}}, 4)
    >>> inv.shape, factor
    (torch.Size([2]), 1.0)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ckptconv.core.families.deepseek_v3 import dim, q_lora
from ckptconv.core.reference import (
    Expert,
    causal_attention,
    mlp,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    rope_parameters,
    routed_experts,
)

Weights = dict[str, torch.Tensor]  # one layer's HF tensors, names without ``model.layers.N.``


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(config: dict[str, Any], rope_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (``attention_factor``) of the config's RoPE (YaRN, or any that
    :func:`~ckptconv.core.reference.rope_inv_freq` computes, scale 1)."""
    p = rope_parameters(config)
    if p["rope_type"] != "yarn":
        return rope_inv_freq(config, rope_dim), 1.0
    base, original = float(p["rope_theta"]), int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or config["max_position_embeddings"] / original)
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    attention = p.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)

    def correction(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(float(p.get("beta_fast") or 32)), correction(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolate = 1 - ramp.clamp(0, 1)
    pos = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate, float(attention)


def softmax_scale(config: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` correction squared."""
    scale = (dim(config, "qk_nope_head_dim") + dim(config, "qk_rope_head_dim")) ** -0.5
    p = rope_parameters(config)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        scale *= _mscale(float(p["factor"]), p["mscale_all_dim"]) ** 2
    return scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of ``x`` (..., seq, rope): pairs ``(2i, 2i+1)`` when ``interleave`` (the output in halves, as HF
    writes it), else ``(i, i + rope/2)``."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def mla_attention(h: torch.Tensor, w: Weights, config: dict[str, Any]) -> torch.Tensor:
    """Multi-head latent attention of ``h`` ``(batch, seq, H)`` (causal), through ``o_proj``."""
    batch, seq, _ = h.shape
    eps = float(config.get("rms_norm_eps", 1e-6))
    nope, rope, v_dim = dim(config, "qk_nope_head_dim"), dim(config, "qk_rope_head_dim"), dim(config, "v_head_dim")
    kv_rank = dim(config, "kv_lora_rank")
    if q_lora(config):
        q = F.linear(rms_norm(F.linear(h, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], eps),
                     w["self_attn.q_b_proj.weight"])
    else:
        q = F.linear(h, w["self_attn.q_proj.weight"])
    q = q.view(batch, seq, -1, nope + rope).transpose(1, 2)
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    kv, k_rot = F.linear(h, w["self_attn.kv_a_proj_with_mqa.weight"]).split([kv_rank, rope], dim=-1)
    kv = rms_norm(kv, w["self_attn.kv_a_layernorm.weight"], eps)
    inv, factor = yarn_inv_freq(config, rope)
    cos, sin = rope_cos_sin(inv, seq, dtype=torch.float32)
    cos, sin = (cos * factor).to(h.dtype), (sin * factor).to(h.dtype)
    interleave = bool(config.get("rope_interleave", True))
    q_rot, k_rot = _rotate(q_rot, cos, sin, interleave), _rotate(k_rot.view(batch, 1, seq, rope), cos, sin, interleave)
    kv = F.linear(kv, w["self_attn.kv_b_proj.weight"]).view(batch, seq, -1, nope + v_dim).transpose(1, 2)
    k_pass, value = kv.split([nope, v_dim], dim=-1)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
    out = causal_attention(query, key, value, scale=softmax_scale(config))
    return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), w["self_attn.o_proj.weight"])


def route_grouped(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                  config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router over tokens ``h`` ``(tokens, H)``: sigmoid scores (fp32) plus the correction bias choose
    the ``topk_group`` groups (of ``n_group``) with the largest sum of their two best, then the top-k experts there;
    the weights are the unbiased scores, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``.
    Returns (weights, expert indices), both ``(tokens, top_k)``."""
    scores = F.linear(h.float(), router.float()).sigmoid()
    choice = scores + bias
    groups = int(config.get("n_group") or 1)
    per_group = choice.view(-1, groups, choice.shape[-1] // groups)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=int(config.get("topk_group") or 1), dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    choice = per_group.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    indices = torch.topk(choice, k=int(config["num_experts_per_tok"]), dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if config.get("norm_topk_prob", False):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * float(config.get("routed_scaling_factor", 1.0)), indices


def experts_of(w: Weights, count: int) -> dict[int, Expert]:
    """Each routed expert's (gate, up, down) of a sparse layer's HF weights."""
    return {e: (w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"],
                w[f"mlp.experts.{e}.down_proj.weight"]) for e in range(count)}


def moe(h: torch.Tensor, w: Weights, config: dict[str, Any]) -> torch.Tensor:
    """The sparse block: the routed experts' weighted sum plus the shared experts."""
    flat = h.reshape(-1, h.shape[-1])
    weights, indices = route_grouped(flat, w["mlp.gate.weight"], w["mlp.gate.e_score_correction_bias"], config)
    routed = routed_experts(flat, weights, indices, experts_of(w, dim(config, "n_routed_experts"))).view_as(h)
    shared = mlp(h, *(w[f"mlp.shared_experts.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")))
    return routed + shared


def decoder_layer(x: torch.Tensor, w: Weights, config: dict[str, Any]) -> torch.Tensor:
    """One decoder layer (dense or sparse: as its weights are) of ``x`` ``(batch, seq, H)``."""
    eps = float(config.get("rms_norm_eps", 1e-6))
    x = x + mla_attention(rms_norm(x, w["input_layernorm.weight"], eps), w, config)
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    if "mlp.gate.weight" in w:
        return x + moe(h, w, config)
    return x + mlp(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])


def mtp_input(hidden: torch.Tensor, next_embeds: torch.Tensor, w: Weights, config: dict[str, Any]) -> torch.Tensor:
    """An MTP layer's input: ``eh_proj(cat(enorm(embedding of the next tokens), hnorm(previous hidden)))``."""
    eps = float(config.get("rms_norm_eps", 1e-6))
    both = torch.cat([rms_norm(next_embeds, w["enorm.weight"], eps), rms_norm(hidden, w["hnorm.weight"], eps)], dim=-1)
    return F.linear(both, w["eh_proj.weight"])

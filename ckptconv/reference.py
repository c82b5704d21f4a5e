"""Llama decoder-layer math in plain torch: the dense reference, and the pieces a tp rank runs.

Both the dense computation (full HF weights) and the sharded one (one rank's shard, partial
outputs summed as the all-reduce would) are built from these functions, so a difference between
them can only come from the weights each side sees. Tests check the dense layer against
``transformers``' ``LlamaDecoderLayer``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies for RoPE: default, linear and llama3 scaling, as HF configs state them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_context = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_context / low, old_context / high
        smooth = (old_context / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (default, linear, llama3)")
    return inv_freq.to(torch.float32)


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim)."""
    return x * cos + _rotate_half(x) * sin


def attention_heads(
    h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, head_dim: int,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of the Q heads in ``wq`` with the K/V heads in ``wk``/``wv``.

    Q head i uses K/V head ``i // (q heads / kv heads)``: the grouping every rank applies to
    the heads it holds. Returns (batch, seq, q_heads * head_dim), heads in ``wq`` order.
    """
    batch, seq, _ = h.shape
    q = (h @ wq.t()).view(batch, seq, -1, head_dim).transpose(1, 2)
    k = (h @ wk.t()).view(batch, seq, -1, head_dim).transpose(1, 2)
    v = (h @ wv.t()).view(batch, seq, -1, head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(batch, seq, -1)


def mlp(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(h @ w_gate.t()) * (h @ w_up.t())) @ w_down.t()


def dense_layer(x: torch.Tensor, weights: dict[str, torch.Tensor], config: dict[str, Any], head_dim: int) -> dict[str, torch.Tensor]:
    """One decoder layer from full HF weights (names without the ``model.layers.N.`` prefix)."""
    eps = float(config.get("rms_norm_eps", 1e-6))
    cos, sin = rope_cos_sin(rope_inv_freq(config, head_dim), x.shape[1])
    h = rms_norm(x, weights["input_layernorm.weight"], eps)
    attn = attention_heads(h, weights["self_attn.q_proj.weight"], weights["self_attn.k_proj.weight"],
                           weights["self_attn.v_proj.weight"], head_dim, cos, sin)
    o = attn @ weights["self_attn.o_proj.weight"].t()
    x1 = x + o
    h2 = rms_norm(x1, weights["post_attention_layernorm.weight"], eps)
    m = mlp(h2, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"], weights["mlp.down_proj.weight"])
    return {"attention": o, "mlp": m, "output": x1 + m}

"""GPT-OSS's decoder-layer math in plain torch, step for step as transformers' ``GptOssDecoderLayer`` computes it.

What it adds to :mod:`ckptconv.core.reference`: YaRN RoPE (its inverse frequencies and the attention factor that
scales cos/sin), attention with per-head sinks (an extra logit per head and query that takes softmax mass and no
value) within the layer's window (``layer_types``: sliding or full), q/k/v/o biases, and the routed experts: the
router's top-k taken on its (biased) logits and softmaxed among themselves, each expert's ``gate_up_proj`` ``[H, 2I]``
with gate and up interleaved column by column, a SwiGLU with a clamp (``swiglu_limit``) and its own ``alpha``,
``(up + 1) * glu``, and biases on both projections. Tests compare each piece with transformers' layers.

    >>> inv, factor = yarn_inv_freq({"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    ...                              "original_max_position_embeddings": 4096, "truncate": False}, 8)
    >>> round(factor, 4), inv.shape
    (1.3466, torch.Size([4]))
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ckptconv.core.families.gpt_oss import ALPHA, layer_window
from ckptconv.core.reference import apply_rope, rms_norm, rope_parameters, window_mask


def yarn_inv_freq(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor: frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by ``factor``, those that turn more than ``beta_fast`` times are kept, a linear
    ramp blends the band between (its ends not rounded when ``truncate`` is false); the attention factor is
    ``0.1 ln(factor) + 1`` unless the config states one (``mscale``/``mscale_all_dim``: their ratio)."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    context = params["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def turns_dim(turns: float) -> float:  # the dimension whose frequency turns ``turns`` times over the context
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(params.get("beta_fast") or 32), turns_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep, float(attention)


def gpt_oss_cos_sin(config: dict[str, Any], head_dim: int, seq_len: int,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(seq, head_dim)`` of positions ``0..seq_len-1``, YaRN's attention factor applied (GPT-OSS's
    rotary embedding; a config without YaRN gets the plain frequencies)."""
    params = rope_parameters(config)
    if params["rope_type"] == "yarn":
        inv, scale = yarn_inv_freq(params, head_dim)
    else:
        inv, scale = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0
    freqs = torch.arange(seq_len).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *,
                   window: int | None = None) -> torch.Tensor:
    """Causal attention over ``(batch, heads, seq, head_dim)`` (K/V already repeated to the q heads) with one sink
    logit per head: the softmax runs over the visible keys and the sink, the sink's share is dropped."""
    seq = q.shape[2]
    logits = (q @ k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    visible = window_mask(seq, window if window is not None else seq, q.device)
    logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, 1).to(logits.dtype)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def swiglu(gate_up: torch.Tensor, *, alpha: float = ALPHA, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's gated activation of ``gate_up`` ``(..., 2I)``: gate the even columns, up the odd ones (interleaved),
    the gate clamped above at ``limit``, up to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_moe(h: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, *, alpha: float = ALPHA,
                limit: float = 7.0) -> torch.Tensor:
    """The routed experts over ``h`` ``(..., H)``: the top-k of the router's biased logits, softmaxed among
    themselves; each chosen expert ``(x @ gate_up + b) -> swiglu -> @ down + b``, weighted and summed in ascending
    expert order. ``w``: the layer's ``mlp.*`` tensors (names without the layer prefix)."""
    flat = h.reshape(-1, h.shape[-1])
    logits = F.linear(flat, w["mlp.router.weight"], w["mlp.router.bias"])
    top, chosen = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top, dim=1, dtype=top.dtype)
    out = torch.zeros_like(flat)
    for e in chosen.unique().tolist():
        token, slot = (chosen == e).nonzero(as_tuple=True)
        x = flat[token] @ w["mlp.experts.gate_up_proj"][e] + w["mlp.experts.gate_up_proj_bias"][e]
        y = swiglu(x, alpha=alpha, limit=limit) @ w["mlp.experts.down_proj"][e] + w["mlp.experts.down_proj_bias"][e]
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out.view_as(h)


def gpt_oss_layer(x: torch.Tensor, w: dict[str, torch.Tensor], config: dict[str, Any], layer: int) -> torch.Tensor:
    """Decoder layer ``layer`` (its window from ``layer_types``) of GPT-OSS from its HF weights ``w`` (names without
    the ``model.layers.N.`` prefix) over ``x`` ``(batch, seq, H)``."""
    batch, seq, _ = x.shape
    hd, eps = int(config["head_dim"]), float(config.get("rms_norm_eps", 1e-5))
    cos, sin = gpt_oss_cos_sin(config, hd, seq, x.dtype)
    h = rms_norm(x, w["input_layernorm.weight"], eps)

    def heads(p: str) -> torch.Tensor:
        return F.linear(h, w[f"self_attn.{p}_proj.weight"], w[f"self_attn.{p}_proj.bias"]).view(
            batch, seq, -1, hd).transpose(1, 2)

    q, k, v = heads("q"), heads("k"), heads("v")
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = q.shape[1] // k.shape[1]
    attn = sink_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), w["self_attn.sinks"],
                          window=layer_window(config, layer))
    x = x + F.linear(attn.transpose(1, 2).reshape(batch, seq, -1), w["self_attn.o_proj.weight"],
                     w["self_attn.o_proj.bias"])
    m = gpt_oss_moe(rms_norm(x, w["post_attention_layernorm.weight"], eps), w, int(config["num_experts_per_tok"]),
                    alpha=float(config.get("swiglu_alpha", ALPHA)), limit=float(config.get("swiglu_limit", 7.0)))
    return x + m

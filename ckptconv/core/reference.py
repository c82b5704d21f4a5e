"""The decoder-layer math in plain torch, the one implementation verify and nxdtrain share.

RoPE (default, linear and llama3 scaling, from the HF config), RMSNorm, attention (causal, optionally
a sliding window; optional q/k/v biases and per-head q/k norms) and the gated MLP, written step for step
as transformers computes them (same dtypes, same order) so that the trainer's losses match it to float
rounding. The dense computation (full HF weights) and the sharded one (one rank's shard, partial
outputs summed as the all-reduce would) are built from these functions, so a difference between them
can only come from the weights each side sees. Tests check the dense layer against transformers'
decoder layers.

    >>> rope_inv_freq({"rope_theta": 10000.0}, head_dim=8)
    tensor([1.0000, 0.1000, 0.0100, 0.0010])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ckptconv.errors import ConversionError

ROPE_TYPES = ("default", "linear", "llama3")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in fp32, cast back, then scaled."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and the scaling parameters, whichever generation of config.json holds them
    (``rope_parameters`` in transformers >= 5, ``rope_theta`` + ``rope_scaling`` before)."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies (``head_dim / 2`` fp32 values) as transformers computes them."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ConversionError(f"config.json: rope_type {rope_type!r} is not supported "
                              f"(supported: {', '.join(ROPE_TYPES)})")
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "linear":
        return inv / float(params["factor"])
    if rope_type == "llama3":
        return _llama3(inv, params)
    return inv


def _llama3(inv: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0..seq_len-1`` (or the given ``positions``), shape ``(seq_len, head_dim)``,
    computed in fp32."""
    if positions is None:
        positions = torch.arange(seq_len, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin broadcast over batch and heads."""
    return x * cos + _rotate_half(x) * sin


@functools.lru_cache(maxsize=4)
def window_mask(seq_len: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (seq, seq) mask, True where query i may see key j: ``i - window < j <= i`` (transformers' sliding
    window: each query sees ``window`` keys, itself included). Built once per shape and device, not for every
    layer of every step (nxdtrain's Mistral): the tensor is shared, so it is only ever read."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (j > i - window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """softmax(QKᵀ·scale)V over (batch, heads, seq, head_dim), causal, within ``window`` keys when given."""
    seq = q.shape[2]
    if window is None or window >= seq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(seq, window, q.device), scale=scale)


def attention_heads(
    h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, head_dim: int,
    cos: torch.Tensor, sin: torch.Tensor, *, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the Q heads in ``wq`` with the K/V heads in ``wk``/``wv``.

    ``bias``: the q/k/v biases of those rows (Qwen2); ``qk_norm``: per-head q and k norm weights and eps,
    applied after the projection and before RoPE (Qwen3). Q head i uses K/V head ``i // (q heads / kv
    heads)``: the grouping every rank applies to the heads it holds. Returns (batch, seq, q_heads *
    head_dim), heads in ``wq`` order.
    """
    batch, seq, _ = h.shape
    bq, bk, bv = bias if bias is not None else (None, None, None)
    q = F.linear(h, wq, bq).view(batch, seq, -1, head_dim).transpose(1, 2)
    k = F.linear(h, wk, bk).view(batch, seq, -1, head_dim).transpose(1, 2)
    v = F.linear(h, wv, bv).view(batch, seq, -1, head_dim).transpose(1, 2)
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = causal_attention(q, k, v, window=window)
    return out.transpose(1, 2).reshape(batch, seq, -1)


def mlp(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(h @ w_gate.t()) * (h @ w_up.t())) @ w_down.t()


def layer_attention_extras(weights: dict[str, torch.Tensor], eps: float) -> dict[str, Any]:
    """The optional attention inputs present in one layer's HF weights: q/k/v biases, q/k norms."""
    extras: dict[str, Any] = {}
    if "self_attn.q_proj.bias" in weights:
        extras["bias"] = tuple(weights[f"self_attn.{p}_proj.bias"] for p in "qkv")
    if "self_attn.q_norm.weight" in weights:
        extras["qk_norm"] = (weights["self_attn.q_norm.weight"], weights["self_attn.k_norm.weight"], eps)
    return extras


def dense_layer(x: torch.Tensor, weights: dict[str, torch.Tensor], config: dict[str, Any], head_dim: int,
                *, window: int | None = None,
                mlp_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One decoder layer from full HF weights (names without the ``model.layers.N.`` prefix). ``mlp_of``: the MLP
    of a sparse layer (e.g. a :func:`sparse_mlp` over the layer's router and experts) instead of the gated MLP."""
    eps = float(config.get("rms_norm_eps", 1e-6))
    cos, sin = rope_cos_sin(rope_inv_freq(config, head_dim), x.shape[1])
    h = rms_norm(x, weights["input_layernorm.weight"], eps)
    attn = attention_heads(h, weights["self_attn.q_proj.weight"], weights["self_attn.k_proj.weight"],
                           weights["self_attn.v_proj.weight"], head_dim, cos, sin, window=window,
                           **layer_attention_extras(weights, eps))
    o = attn @ weights["self_attn.o_proj.weight"].t()
    x1 = x + o
    h2 = rms_norm(x1, weights["post_attention_layernorm.weight"], eps)
    if mlp_of is not None:
        m = mlp_of(h2)
    else:
        m = mlp(h2, weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"], weights["mlp.down_proj.weight"])
    return {"attention": o, "mlp": m, "output": x1 + m}


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, *, normalize: bool,
          cast_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k router of a sparse MLP over tokens ``h`` ``(tokens, H)``: softmax of the logits in fp32, the
    ``top_k`` largest probabilities, divided by their sum when ``normalize``; ``cast_back``: the weights are cast to
    the logits' dtype (Qwen3-MoE's router does; Mixtral's keeps them fp32). Returns (weights, expert indices), both
    ``(tokens, top_k)``, as transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter`` compute them.

        >>> w, e = route(torch.tensor([[1.0, 0.0]]), torch.eye(2), 1, normalize=True)
        >>> w.tolist(), e.tolist()
        ([[1.0]], [[0]])
    """
    return route_logits(F.linear(h, router), top_k, normalize=normalize, cast_back=cast_back)


def route_logits(logits: torch.Tensor, top_k: int, *, normalize: bool,
                 cast_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` from the router's logits ``(..., E)`` (the trainer computes them once, for the aux loss too)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if cast_back else weights), indices


Expert = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # one expert's (gate [I, H], up [I, H], down [H, I])


def routed_experts(h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                   experts: dict[int, Expert]) -> torch.Tensor:
    """The weighted sum over the routed experts of tokens ``h`` ``(tokens, H)``, counting only the experts in
    ``experts`` (expert index -> its weights): with all of them, the sparse block's output; with one ep rank's (or
    one tp rank's rows of them), that rank's partial output, which summed over ep and tp ranks is the block's.
    Experts are added in ascending index order, each on the tokens routed to it, as transformers' experts module
    does."""
    out = torch.zeros_like(h)
    for e in sorted(experts):
        slot_token = (indices == e).nonzero()
        if not len(slot_token):
            continue
        token, slot = slot_token[:, 0], slot_token[:, 1]
        gate, up, down = experts[e]
        y = mlp(h[token], gate, up, down) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def sparse_mlp(h: torch.Tensor, router: torch.Tensor, experts: dict[int, Expert], top_k: int, *, normalize: bool,
               cast_back: bool = False) -> torch.Tensor:
    """A sparse MLP block over ``h`` ``(..., H)``: :func:`route`, then :func:`routed_experts`."""
    flat = h.reshape(-1, h.shape[-1])
    weights, indices = route(flat, router, top_k, normalize=normalize, cast_back=cast_back)
    return routed_experts(flat, weights, indices, experts).view_as(h)

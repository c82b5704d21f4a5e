"""Rotary position embedding as transformers' Llama computes it, from the HF config alone.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3`` (Llama 3.1+), read from
``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling`` (older configs).
The arithmetic follows transformers step by step (same dtypes, same order) so that losses
match it to float rounding.

    >>> inv = inv_freq({"hidden_size": 64, "num_attention_heads": 8, "rope_theta": 10000.0})
    >>> inv.shape, float(inv[0])
    (torch.Size([4]), 1.0)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nxdtrain.errors import TrainError

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and the scaling parameters, whichever generation of config.json holds them."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inv_freq(config: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (``head_dim / 2`` floats) for an HF Llama config."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise TrainError(f"config.json: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
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


def cos_sin(inv: torch.Tensor, seq_len: int, dtype: torch.dtype,
            positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0..seq_len-1`` (or the ``seq_len`` given ``positions``: a context-parallel
    rank's global ones), shape ``(1, seq_len, head_dim)``, computed in fp32 (elementwise: a position's
    values do not depend on which others are computed with it)."""
    if positions is None:
        positions = torch.arange(seq_len, device=inv.device)
    freqs = positions[None, :, None].float() * inv.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``(batch, heads, seq, head_dim)`` queries and keys."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

"""Rotary position embedding for the trainer: ckptconv's reference math (:mod:`ckptconv.core.reference`) in the shapes
the stages use.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3`` (Llama 3.1+), read from
``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling`` (older configs).
The arithmetic follows transformers step by step (same dtypes, same order) so that losses
match it to float rounding.

    >>> inv = inv_freq({"hidden_size": 64, "num_attention_heads": 8, "rope_theta": 10000.0})
    >>> inv.shape, float(inv[0])
    (torch.Size([4]), 1.0)
"""

from __future__ import annotations

from typing import Any

import torch

from ckptconv.core import ROPE_TYPES, rope_cos_sin, rope_inv_freq, rope_parameters
from ckptconv.core import apply_rope as reference_apply_rope

__all__ = ["ROPE_TYPES", "apply_rope", "cos_sin", "inv_freq", "rope_parameters"]


def inv_freq(config: dict[str, Any], head_dim: int | None = None) -> torch.Tensor:
    """Inverse frequencies (``head_dim / 2`` floats) for an HF config; ``head_dim`` defaults to the config's
    (explicit ``head_dim``, else hidden / heads)."""
    dim = head_dim or config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return rope_inv_freq(config, dim)


def cos_sin(inv: torch.Tensor, seq_len: int, dtype: torch.dtype,
            positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0..seq_len-1`` (or the ``seq_len`` given ``positions``: a context-parallel
    rank's global ones), shape ``(1, seq_len, head_dim)``, computed in fp32 (elementwise: a position's
    values do not depend on which others are computed with it)."""
    cos, sin = rope_cos_sin(inv, seq_len, dtype, positions=positions)
    return cos[None], sin[None]


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``(batch, heads, seq, head_dim)`` queries and keys."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return reference_apply_rope(q, cos, sin), reference_apply_rope(k, cos, sin)

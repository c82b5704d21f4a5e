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
    if q.device.type == "xla" or cos.requires_grad or sin.requires_grad:  # XLA fuses the expression itself
        return reference_apply_rope(q, cos, sin), reference_apply_rope(k, cos, sin)
    return _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)


class _Rope(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` and its gradient, the reference's arithmetic op for op, written into one
    buffer each way. Autograd of the reference makes five temporaries forward (a product, a negated half, a
    ``cat``, a product, the sum) and backward two zero-padded halves summed into the product. The values are the
    same: ``(-a) * b`` is ``-(a * b)`` and ``c + (-d)`` is ``c - d`` exactly; the backward ends with ``+ 0.0``
    because autograd's sum of the zero-padded halves turns a -0.0 into +0.0 (a position whose gradient is zero).
    Measured: docs/performance.md, issue #47's third pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half] -= x[..., half:] * sin[..., :half]
        out[..., half:] += x[..., :half] * sin[..., half:]
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        # contiguous, as autograd's sum is (it starts from a zero-padded half): the layout decides the summation
        # order of the gradients after it (the q/k norm weights' sum over positions)
        d_x = torch.mul(grad, cos, out=torch.empty(grad.shape, dtype=grad.dtype, device=grad.device))
        d_x[..., half:] -= grad[..., :half] * sin[..., :half]
        d_x[..., :half] += grad[..., half:] * sin[..., half:]
        return d_x.add_(0.0), None, None

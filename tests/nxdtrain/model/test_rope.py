"""nxdtrain's RoPE (one buffer each way) against autograd of the reference expression: the same bits, forward and
backward, and the gradient in the layout autograd gives it (the layout sets the summation order of what follows)."""

from __future__ import annotations

import pytest
import torch

from ckptconv.core import apply_rope as reference_apply_rope
from nxdtrain.model.rope import apply_rope, cos_sin, inv_freq


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _run(rotate, dtype: torch.dtype, transposed: bool) -> list[torch.Tensor]:
    """q and k as the stage makes them (a per-head-dim scale, like the q/k norms, on the projection's
    [batch, seq, heads, head_dim] viewed as [batch, heads, seq, head_dim]), rotated, then a weighted sum."""
    g = torch.Generator().manual_seed(0)
    cos, sin = cos_sin(inv_freq({"hidden_size": 256, "num_attention_heads": 8, "rope_theta": 1e6}), 64, dtype)
    base_q = torch.randn(2, 64, 8, 32, generator=g).to(dtype).requires_grad_()
    base_k = torch.randn(2, 64, 2, 32, generator=g).to(dtype).requires_grad_()
    scale = (torch.rand(32, generator=g) + 0.5).to(dtype).requires_grad_()
    q, k = ((t * scale).transpose(1, 2) if transposed else (t * scale).transpose(1, 2).contiguous()
            for t in (base_q, base_k))
    # the gradient arriving from attention in [batch, seq, heads, head_dim] memory, as SDPA's backward gives it
    weights = [torch.randn(t.transpose(1, 2).shape, generator=g).to(dtype).transpose(1, 2) for t in (q, k)]
    for w in weights:  # positions whose gradient is zero (a sequence's last token), of both signs
        w[:, :, -1] = 0.0
        w[:, :, -2] = -0.0
    out_q, out_k = rotate(q, k, cos, sin)
    loss = (out_q * weights[0]).sum() + (out_k * weights[1]).sum()
    grads = torch.autograd.grad(loss, (base_q, base_k, scale))
    return [out_q.detach(), out_k.detach(), *grads]


def _reference(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return reference_apply_rope(q, cos, sin), reference_apply_rope(k, cos, sin)


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_reference_bit_for_bit(dtype, transposed):
    ours, theirs = _run(apply_rope, dtype, transposed), _run(_reference, dtype, transposed)
    for name, a, b in zip(("q", "k", "d base_q", "d base_k", "d scale"), ours, theirs, strict=True):
        assert a.stride() == b.stride(), name
        assert torch.equal(_bits(a), _bits(b)), name


def test_rope_rotates_as_transformers():
    """The forward against transformers' own apply_rotary_pos_emb (an independent reference)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    cos, sin = cos_sin(inv_freq({"hidden_size": 128, "num_attention_heads": 4, "rope_theta": 1e4}), 16, torch.float32)
    q, k = torch.randn(1, 4, 16, 32, generator=g), torch.randn(1, 2, 16, 32, generator=g)
    ours, theirs = apply_rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])

"""The MoE block's hand-written pieces (issue 47): the grouped expert MLP (nxdtrain.model.grouped) and the dispatch's
gather and combine (nxdtrain.parallel.experts.routed at ep 1) give autograd's values exactly, forward and backward,
against the per-expert expression transformers' experts module evaluates (one expert at a time on its rows in token
order, the outputs index-added in ascending expert order; fp32). Hidden != intermediate, more experts than top-k, an
expert that gets no row; top-3 so that the order in which a token's outputs are added matters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxdtrain.model.grouped import grouped_mlp
from nxdtrain.parallel.experts import EpGroup, routed

E, H, INTER, T = 6, 16, 24, 40


def _expert(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, e: int) -> torch.Tensor:
    gate, up = (rows @ gate_up[e]).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down[e]


def _leaves(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
                 for shape in ((T, H), (E, H, 2 * INTER), (E, INTER, H)))


def _grads(out: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mlp_is_autograds_per_expert_expression(dtype):
    x, gate_up, down = leaves = _leaves(dtype)
    sizes = [7, 0, 13, 9, 0, 11]  # experts 1 and 4 get no row: their weight gradients are zeros
    ours = _grads(grouped_mlp(x, gate_up, down, sizes), leaves)
    reference = _grads(torch.cat([_expert(rows, gate_up, down, e) for e, rows in enumerate(x.split(sizes))]), leaves)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    assert not ours[2][1].any() and ours[2][0].any()


def test_routed_at_ep1_is_transformers_experts_loop():
    x, gate_up, down = _leaves(torch.float32)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    logits[:, 5] = -1e9  # expert 5 is never chosen
    weights, indices = torch.softmax(logits, -1).topk(3, dim=-1)
    weights = weights.requires_grad_()
    leaves = (x, gate_up, down, weights)
    ours = _grads(routed(x, weights, indices, EpGroup(), E, lambda rows, sizes: grouped_mlp(rows, gate_up, down, sizes)),
                  leaves)
    out = torch.zeros_like(x)
    for e in range(E):  # Qwen3MoeExperts.forward's loop: expert e on its tokens in token order
        token, slot = torch.where(indices == e)
        y = _expert(x[token], gate_up, down, e) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(x.dtype))
    (out, d_x, *rest), (ref_out, ref_d_x, *ref_rest) = ours, _grads(out, leaves)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(rest, ref_rest, strict=True))
    # a token's 3 gradients: ours added in expert order, the loop's in the order its autograd accumulates them
    torch.testing.assert_close(d_x, ref_d_x, rtol=0, atol=1e-5)

"""Ring attention against plain causal softmax attention on the whole sequence, forward and backward.

Each case runs ``cp`` gloo processes; every process builds the same whole-row q, k, v (one seed),
takes its zigzag chunks, runs the ring, and compares its output and its chunks' gradients with
``scaled_dot_product_attention`` over the whole row (the reference trainer's attention).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nxdtrain.parallel.context import CpGroup, split_sequence, zigzag_positions
from nxdtrain.parallel.dist import spawn
from nxdtrain.parallel.ring_attention import ring_attention

TOL = 1e-5


def _case(cp_size: int, heads: int, kv_heads: int, seq: int, check_kv_index: bool) -> None:
    dist.init_process_group("gloo", init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        rank = dist.get_rank()
        cp = CpGroup(cp_size, rank, dist.group.WORLD, tuple(range(cp_size)))
        gen = torch.Generator().manual_seed(11)
        batch, dim = 2, 8
        q = torch.randn(batch, heads, seq, dim, generator=gen)
        k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
        v = torch.randn(batch, kv_heads, seq, dim, generator=gen)
        grad = torch.randn(batch, heads, seq, dim, generator=gen)
        # Q head h uses K/V head h // group (Llama's GQA); a shuffled map checks kv_index is honoured, not assumed.
        index = torch.arange(heads) // (heads // kv_heads)
        if check_kv_index:
            index = index.flip(0)
        scale = dim ** -0.5

        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(ref_in[0], ref_in[1].index_select(1, index),
                                             ref_in[2].index_select(1, index), is_causal=True, scale=scale)
        ref.backward(grad)

        mine = [split_sequence(t, cp, dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, cp, scale=scale, kv_index=None if heads == kv_heads else index)
        out.backward(split_sequence(grad, cp, dim=2))

        def worst(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a - split_sequence(b, cp, dim=2)).abs().max())

        errors = {"out": worst(out.detach(), ref.detach())}
        errors.update({f"d{name}": worst(m.grad, r.grad) for name, m, r in zip("qkv", mine, ref_in, strict=True)})
        assert max(errors.values()) <= TOL, f"cp rank {rank}: {errors}"
        assert zigzag_positions(seq, cp).tolist() == split_sequence(torch.arange(seq)[None], cp)[0].tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp,heads,kv_heads,seq,shuffled", [
    (2, 4, 4, 16, False),    # MHA
    (2, 4, 2, 24, False),    # GQA: K/V travel with 2 heads, expanded per block
    (4, 4, 1, 32, True),     # MQA over 4 ranks, an arbitrary Q -> K/V head map
    (4, 2, 2, 8, False),     # one token per chunk
], ids=["cp2-mha", "cp2-gqa", "cp4-mqa", "cp4-tiny-chunks"])
def test_ring_attention_matches_causal_softmax(cp, heads, kv_heads, seq, shuffled):
    assert spawn(_case, (cp, heads, kv_heads, seq, shuffled), cp, timeout_s=120) == 0

"""Ring attention: causal softmax attention over a sequence split across the context-parallel ranks.

Each cp rank holds the queries, keys and values of its two zigzag chunks
(:mod:`nxdtrain.parallel.context`). The forward makes ``cp`` steps: at step ``t`` a rank holds the
K/V of cp rank ``rank - t`` (its own first) and attends its query chunks to those key chunks that
are not in their future (a key chunk before the query chunk: every key; the same chunk: causal;
a later chunk: skipped), while the K/V block travels on to the next rank (``batch_isend_irecv``,
overlapped with the step's compute where the backend runs point-to-point ops asynchronously). The
partial results are merged with a running log-sum-exp, in fp32. The backward recomputes each
block's probabilities from the saved q, k, v, output and log-sum-exp (nothing per block is kept),
and sends each block's dK/dV accumulator around the ring with the block, so that it arrives back
at its owner after ``cp`` steps holding every rank's contribution.

GQA: K/V travel with their own (fewer) heads; ``kv_index`` (the K/V head of each local Q head)
expands them at each block, and the expanded gradients are summed back per K/V head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nxdtrain.parallel.context import CpGroup

KV_TAG, GRAD_TAG = 0, 1  # point-to-point tags: a step's K/V and dK/dV never match each other's receives


def _exchange(tensors: list[torch.Tensor], cp: CpGroup, tag: int) -> tuple[list[Any], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's."""
    after, before = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, after, cp.group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, before, cp.group, tag) for t in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _pairs(cp: CpGroup, source: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of this rank's local chunks against ``source``'s, future ones left out."""
    out = []
    for i, q_chunk in enumerate(cp.chunks):
        for j, k_chunk in enumerate(cp.chunks_of(source)):
            if k_chunk <= q_chunk:
                out.append((i, j, k_chunk == q_chunk))
    return out


def _expand(x: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    return x if kv_index is None else x.index_select(1, kv_index)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CpGroup, scale: float,
                kv_index: torch.Tensor | None) -> torch.Tensor:
        qs = q.float().chunk(2, dim=2)
        out = [torch.zeros_like(x) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), device=x.device) for x in qs]
        kv = [k.contiguous(), v.contiguous()]
        for step in range(cp.size):
            pending = _exchange(kv, cp, KV_TAG) if step < cp.size - 1 else None
            ks, vs = (_expand(t.float(), kv_index).chunk(2, dim=2) for t in kv)  # GQA heads copied once a step
            for i, j, causal in _pairs(cp, (cp.rank - step) % cp.size):
                s = _scores(qs[i], ks[j], scale, causal)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(torch.exp(s - block_lse.unsqueeze(-1)), vs[j])
                merged = torch.logaddexp(lse[i], block_lse)
                out[i] = (out[i] * torch.exp(lse[i] - merged).unsqueeze(-1)
                          + block_out * torch.exp(block_lse - merged).unsqueeze(-1))
                lse[i] = merged
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        result, total_lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, result, total_lse, kv_index)
        ctx.cp, ctx.scale = cp, scale
        return result.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, kv_index = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        qs = q.float().chunk(2, dim=2)
        grads = grad_out.float().chunk(2, dim=2)
        lses = lse.chunk(2, dim=2)
        # D = rowsum(dO * O): the softmax backward's correction term, per query.
        deltas = (grad_out.float() * out).sum(-1).chunk(2, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros(v.shape, dtype=torch.float32,
                                                                                      device=v.device)]
        for step in range(cp.size):
            pending = _exchange(kv, cp, KV_TAG) if step < cp.size - 1 else None
            ks, vs = (_expand(t.float(), kv_index).chunk(2, dim=2) for t in kv)
            dks, dvs = (t.chunk(2, dim=2) for t in dkv)  # views: accumulate in place
            for i, j, causal in _pairs(cp, (cp.rank - step) % cp.size):
                key, value = ks[j], vs[j]
                p = torch.exp(_scores(qs[i], key, scale, causal) - lses[i].unsqueeze(-1))
                dv = torch.matmul(p.transpose(-1, -2), grads[i])
                ds = p * (torch.matmul(grads[i], value.transpose(-1, -2)) - deltas[i].unsqueeze(-1))
                dq[i] += torch.matmul(ds, key) * scale
                dk = torch.matmul(ds.transpose(-1, -2), qs[i]) * scale
                if kv_index is None:
                    dks[j].add_(dk)
                    dvs[j].add_(dv)
                else:  # the expanded heads' gradients, summed back onto the K/V head each one copied
                    dks[j].index_add_(1, kv_index, dk)
                    dvs[j].index_add_(1, kv_index, dv)
            # The accumulators follow their block: after the last step one more hop brings them home.
            grad_requests, dkv = _exchange(dkv, cp, GRAD_TAG)
            _wait(grad_requests)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        return (torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CpGroup, *, scale: float,
                   kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention ``[batch, heads, local seq, head_dim]`` of this rank's zigzag chunks over the whole row.

    ``k``/``v`` may have fewer heads than ``q``: ``kv_index[h]`` is the K/V head of local Q head ``h``.
    """
    return _RingAttention.apply(q, k, v, cp, scale, kv_index)

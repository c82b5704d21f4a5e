"""Expert parallelism: the tokens routed to experts held by other ep ranks travel there and back by all-to-all.

NxD carves the ep ranks out of data parallel (mesh ``[PP, DP_exp, EP, TP]`` in expert regions): data-parallel rank
``dp = dp_exp * EP + ep_rank`` holds experts ``[ep_rank E/EP, (ep_rank+1) E/EP)``, and the ranks that differ only in
``ep_rank`` (same pp, tp and dp_exp) form an ep group. Every rank of the group routes its own rows; each
(token, slot) assignment's hidden state goes to the rank holding its expert, which computes it and sends the output
back (the per-expert counts, exchanged first, tell the receiver each row's expert). The exchange is ``all_to_all_single`` with uneven splits: gloo has it on CPU (checked:
torch 2.13), NCCL on GPU; its backward is the same exchange the other way. The tp ranks of an ep rank hold the
same tokens and each its ``I/tp`` columns of every expert, so each exchanges with the same tp rank of its peers and
the partial outputs are summed over tp afterwards, as for a dense row-parallel layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EpGroup:
    """This rank's expert-parallel group (None when ep is 1 or offline)."""

    size: int = 1
    rank: int = 0
    group: Any = None


class _AllToAll(torch.autograd.Function):
    """Rows ``send[r]`` at a time to rank r of the group, ``recv[r]`` rows from it; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (send, recv), group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send, recv = ctx.splits
        return _exchange(grad.contiguous(), recv, send, ctx.group), None, None, None


class Traffic:
    """Bytes this process has sent to other ep ranks by all-to-all, forward and backward (``make bench-train``)."""

    sent = 0


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    row = x[0].numel() * x.element_size() if len(x) else 0
    Traffic.sent += (sum(send) - send[dist.get_rank(group)]) * row
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def routed(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ep: EpGroup, per_rank: int,
           experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
           masked: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{indices[t, j]}(x[t])`` for this rank's tokens ``x`` ``(tokens, H)``, each
    expert computed on the ep rank holding it (``per_rank`` experts each); ``experts(rows, sizes)`` computes this
    rank's experts on rows grouped by expert, ``sizes[e]`` rows of local expert e after those of e - 1 (``masked(rows,
    local_ids)`` instead on xla: :func:`by_mask`). Outputs are added per token in ascending expert order, as
    transformers' experts module (and :func:`ckptconv.core.reference.routed_experts`) adds them (a sum of two
    is the same either way; from three slots on, each token's slots are sorted by expert first).

    The per-expert counts say everything the receiver needs: one all-to-all of them (rank r's counts of the experts
    rank s holds go to s), one host sync for the splits, and the rows travel; what rank s receives from rank r is in
    expert order, so s knows each row's expert without being sent it. At ep 1 the sorted rows are already grouped."""
    k = indices.shape[-1]
    if k > 2:  # each token's slots in ascending expert order: its k outputs are then added in that order below
        indices, slots = indices.sort(dim=-1, stable=True)
        weights = weights.gather(-1, slots)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments by expert, hence by the rank that owns it
    if masked is not None:  # xla: no data-dependent shapes (nor ep > 1); autograd's own gather and scatter-add
        token = order // k  # (the permutations below abort XLA:CPU: "Check failed: buffer != nullptr", shape.h)
        out = masked(x.index_select(0, token), flat[order]) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, out.to(x.dtype))
    back = _inverse(order)
    rows = _Dispatch.apply(x, order, back, k)
    if ep.size > 1:
        counts = torch.bincount(flat, minlength=ep.size * per_rank)
        received = torch.empty_like(counts)  # [source rank, local expert]
        dist.all_to_all_single(received, counts, group=ep.group)
        sent_by_expert, got = (c.view(ep.size, per_rank) for c in torch.stack([counts, received]).cpu())
        send, recv = sent_by_expert.sum(1).tolist(), got.sum(1).tolist()  # the one host sync (.cpu above)
        rows = _AllToAll.apply(rows, send, recv, ep.group)
        perm = _expert_major(got).to(rows.device)
        unperm = _inverse(perm)
        grouped = experts(_Permute.apply(rows, perm, unperm), got.sum(0).tolist())
        out = _AllToAll.apply(_Permute.apply(grouped, unperm, perm), recv, send, ep.group)
    else:
        out = experts(rows, torch.bincount(flat, minlength=per_rank).tolist())
    by_slot = _Permute.apply(out, back, order).view(len(x), k, -1)  # (token, slot) order again
    return (by_slot * weights.unsqueeze(-1)).to(x.dtype).sum(1)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse permutation."""
    return torch.empty_like(perm).index_copy_(0, perm, torch.arange(len(perm), device=perm.device))


class _Dispatch(torch.autograd.Function):
    """``x[order // k]``: each token's row once per slot, in expert order. Backward: the k gradients of a token
    summed in slot order (autograd's ``index_select`` backward would zero a buffer and scatter-add into it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, back: torch.Tensor, k: int) -> torch.Tensor:
        ctx.back, ctx.k = back, k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        by_slot = grad.index_select(0, ctx.back)
        return by_slot.view(-1, ctx.k, by_slot.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse is ``back``; backward: ``grad[back]``, a copy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, perm: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.back = back
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.index_select(0, ctx.back), None, None


def _expert_major(got: torch.Tensor) -> torch.Tensor:
    """The received rows (source-major, expert order within each source: ``got[source, expert]`` rows) in expert-major
    order, sources in rank order within an expert: the order a stable sort by expert gives."""
    starts = (got.reshape(-1).cumsum(0) - got.reshape(-1)).view_as(got)
    spans = [torch.arange(int(starts[r, e]), int(starts[r, e] + got[r, e]))
             for e in range(got.shape[1]) for r in range(got.shape[0])]
    return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.int64)


def by_mask(rows: torch.Tensor, ids: torch.Tensor, count: int,
            expert: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """``expert(rows of id e, e)`` for each local expert e, on xla, where shapes must not depend on the routing
    (XLA:CPU aborts on bincount; a data-dependent split would compile a graph per routing): every local expert runs
    on every row and a mask keeps the row's own expert, ``count`` times the experts' FLOPs. Exact: the other experts
    add zeros."""
    out = torch.zeros_like(rows)
    for e in range(count):
        out = out + expert(rows, e) * (ids == e).unsqueeze(-1).to(rows.dtype)
    return out

"""Sequence parallelism (NxD/Megatron scheme): between tp regions activations are split along the sequence.

Outside the tensor-parallel layers (norms, residual adds, the tensors passed between pipeline
stages) each tp rank holds ``seq/tp`` consecutive positions of every row, ``[batch, seq/tp,
hidden]``. Entering a column-parallel layer gathers the sequence (backward: reduce-scatter of the
gradient); leaving a row-parallel layer (or the vocab-parallel embedding) reduce-scatters the
partial sums over the sequence instead of all-reducing them (backward: all-gather). Norm weights
then see only their slice: their gradients are summed over tp (nxdtrain.parallel.grads).

Only an all-gather and a reduce-scatter into one tensor and ``all_reduce`` are used: the
collectives gloo, NCCL and torch-xla all provide. They work on dimension 0, so the sequence
(dimension 1) is moved to the front around each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from nxdtrain.parallel.tp_group import TpGroup

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn, once per
# rank); the torch that torch-xla 2.9 needs has only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """``[b, s/tp, h]`` slices of all tp ranks -> ``[b, s, h]`` (rank order along the sequence)."""
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((front.shape[0] * tp.size, *front.shape[1:]))
    _ALL_GATHER(out, front, group=tp.group)
    return out.transpose(0, 1)


def _reduce_scatter(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """``[b, s, h]`` partial sums -> this rank's ``[b, s/tp, h]`` slice of their sum over tp."""
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((front.shape[0] // tp.size, *front.shape[1:]))
    _REDUCE_SCATTER(out, front, group=tp.group)
    return out.transpose(0, 1).contiguous()  # a slice is what pipeline stages send: p2p needs contiguous


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
        ctx.tp = tp
        return _gather(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
        ctx.tp = tp
        return _reduce_scatter(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.tp), None


def gather_seq(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Into a column-parallel layer: all-gather the sequence forward, reduce-scatter the gradient backward."""
    return x if tp.group is None else _GatherSeq.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Out of a row-parallel layer: reduce-scatter over the sequence forward, all-gather the gradient backward."""
    return x if tp.group is None else _ReduceScatterSeq.apply(x, tp)


def seq_slice(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """This rank's positions of a full-sequence tensor (no communication; for tests and references)."""
    width = x.shape[1] // tp.size
    return x[:, tp.rank * width:(tp.rank + 1) * width]

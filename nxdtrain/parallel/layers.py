"""Tensor-parallel layers with NxD's parameter names and local shapes, in plain torch.

The classes mirror ``neuronx_distributed.parallel_layers``: a layer's ``weight`` (or
``weight_q``/``weight_k``/``weight_v``/``weight_qkv``) has exactly the shape of the tensor a
shard stores for this tp rank, so shards load with ``strict=True``. The tp collectives are the
two classic conjugate operators: ``copy_to_tp`` (identity forward, all-reduce backward) in front
of a column-parallel layer, ``reduce_from_tp`` (all-reduce forward, identity backward) behind a
row-parallel one. They are no-ops when tp is 1 (``group`` is None). With sequence parallelism
(``TpGroup.sequence_parallel``) they become a sequence all-gather and a reduce-scatter
(:mod:`nxdtrain.parallel.sequence`); :func:`enter_tp` and :func:`leave_tp` pick the pair.

These layers run on any torch device; the real NxD layers (Trainium, XLA) are never required.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxdtrain.parallel.sequence import gather_seq, reduce_scatter_seq
from nxdtrain.parallel.tp_group import TpGroup  # also reached as nxdtrain.parallel.layers.TpGroup


def _all_reduce(t: torch.Tensor, tp: TpGroup, op: Any = None) -> torch.Tensor:
    if tp.group is None:
        return t
    t = t.clone()
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=tp.group)
    return t


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (the input feeds every tp rank's slice)."""
    return x if tp.group is None else _CopyToTp.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """All-reduce forward (sum of partial products); identity backward."""
    return x if tp.group is None else _ReduceFromTp.apply(x, tp)


def enter_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """The input of column-parallel layers: one region per input, however many layers read it."""
    return gather_seq(x, tp) if tp.sequence_parallel else copy_to_tp(x, tp)


def leave_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """The partial sums of a row-parallel layer (or the vocab-parallel embedding), summed over tp."""
    return reduce_scatter_seq(x, tp) if tp.sequence_parallel else reduce_from_tp(x, tp)


def _empty(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    # Zeros, not torch.empty: every parameter is overwritten from a shard, and zeros keep a
    # forgotten load visible instead of random.
    return nn.Parameter(torch.zeros(rows, cols, dtype=dtype))


def _empty_bias(rows: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(rows, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r.T (+ b_r)`` where ``W_r`` (``weight``, ``out_local x in``) is this rank's rows of W and
    ``b_r`` (``bias``, with ``bias=True``) the same rows of the bias."""

    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_local: int, tp: TpGroup, *, dtype: torch.dtype = torch.float32,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _empty(out_local, in_features, dtype)
        self.bias = _empty_bias(out_local, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(enter_tp(x, self.tp))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The product alone, for an input that already went through :func:`enter_tp`."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ W_r.T`` where ``W_r`` (``weight``, ``out x in_local``) is this rank's columns of W."""

    def __init__(self, in_local: int, out_features: int, tp: TpGroup, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _empty(out_features, in_local, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return leave_tp(F.linear(x, self.weight), self.tp)


class ParallelEmbedding(nn.Module):
    """Vocab-parallel embedding: ``weight`` holds rows ``[vocab_start, vocab_start + rows)``.

    Ids outside the range look up row 0 and are zeroed; the all-reduce (or, with sequence
    parallelism, the reduce-scatter into sequence slices) adds the one rank that holds each id.
    """

    def __init__(self, rows: int, hidden: int, tp: TpGroup, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start = tp.rank * rows
        self.weight = _empty(rows, hidden, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class GQAQKVColumnParallelLinear(nn.Module):
    """The GQA QKV layer: this rank's Q heads and its (possibly replicated) K/V heads.

    Parameters are ``weight_q``/``weight_k``/``weight_v`` or, with ``fuse``, one ``weight_qkv`` =
    ``cat(weight_q, weight_k, weight_v)`` (rows ``q_rows``, ``kv_rows``, ``kv_rows``); with ``bias``, the biases
    of the same rows ``bias_q``/``bias_k``/``bias_v`` or ``bias_qkv``.
    """

    def __init__(self, hidden: int, q_rows: int, kv_rows: int, tp: TpGroup, *, fuse: bool,
                 dtype: torch.dtype = torch.float32, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.sizes = (q_rows, kv_rows, kv_rows)
        self.fuse, self.has_bias = fuse, bias
        parts = ("qkv",) if fuse else ("q", "k", "v")
        rows = (q_rows + 2 * kv_rows,) if fuse else self.sizes
        for part, n in zip(parts, rows, strict=True):
            setattr(self, f"weight_{part}", _empty(n, hidden, dtype))
        for part, n in zip(parts, rows, strict=True):
            if bias:
                setattr(self, f"bias_{part}", _empty_bias(n, dtype))

    def _linear(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return F.linear(x, getattr(self, f"weight_{part}"), getattr(self, f"bias_{part}") if self.has_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = enter_tp(x, self.tp)
        if self.fuse:
            q, k, v = self._linear(x, "qkv").split(self.sizes, dim=-1)
            return q, k, v
        return self._linear(x, "q"), self._linear(x, "k"), self._linear(x, "v")

    def kv_rows(self) -> list[tuple[nn.Parameter, slice]]:
        """(parameter, rows) holding K and V (weights and biases): replicated on other ranks when
        kv_size_multiplier > 1."""
        q, kv, _ = self.sizes
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        if self.fuse:
            return [(getattr(self, f"{kind}_qkv"), slice(q, q + 2 * kv)) for kind in kinds]
        return [(getattr(self, f"{kind}_{p}"), slice(0, kv)) for kind in kinds for p in "kv"]


# --------------------------------------------------------------------------------------------
# Loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split by vocabulary across tp ranks (fp32 math)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp: TpGroup, ignore_index: int,
                overwrite: bool) -> torch.Tensor:
        logits_dtype = logits.dtype
        owned = overwrite or logits.dtype != torch.float32  # .float() of bf16 logits is a copy of our own
        logits = logits.float()
        rows = logits.shape[-1]
        start = tp.rank * rows
        top = _all_reduce(logits.max(dim=-1).values, tp, dist.ReduceOp.MAX)
        local = target - start
        mine = (local >= 0) & (local < rows) & (target != ignore_index)
        picked = logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) - top
        # One [tokens, vocab] buffer: shifted, exponentiated and normalised in place, in the logits themselves when
        # they are ours to overwrite (the same subtraction as into a new buffer: the same values, one fresh
        # [tokens, vocab] allocation fewer, which at these sizes is a page-faulted mmap on every call).
        probs = (logits.sub_(top.unsqueeze(-1)) if owned else torch.sub(logits, top.unsqueeze(-1))).exp_()
        sum_exp = _all_reduce(probs.sum(dim=-1), tp)
        target_logit = _all_reduce(torch.where(mine, picked, 0.0), tp)
        ignored = target == ignore_index
        loss = torch.where(ignored, 0.0, sum_exp.log() - target_logit)
        ctx.save_for_backward(probs.div_(sum_exp.unsqueeze(-1)), local, mine, ignored)
        ctx.input_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        grad_logits, local, mine, ignored = ctx.saved_tensors  # the softmax, turned into its gradient in place
        # Minus one at each token's target column on the rank that holds it (-0.0 elsewhere: bitwise a no-op);
        # a scatter, not a boolean-mask index, so the shapes stay static (XLA) and nothing syncs with the host.
        index = local.clamp(0, grad_logits.shape[-1] - 1).unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -mine.unsqueeze(-1).to(grad_logits.dtype))
        scale = torch.where(ignored, 0.0, grad).unsqueeze(-1)
        return grad_logits.mul_(scale).to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TpGroup,
                                 *, ignore_index: int = -100, overwrite: bool = False) -> torch.Tensor:
    """Cross-entropy of every token (0 where ``target == ignore_index``), in fp32.

    ``logits`` are this rank's vocabulary slice ``[rank·V/tp, (rank+1)·V/tp)``; the max, the
    sum of exponentials and the target logit are all-reduced so every rank gets the full loss.
    ``overwrite``: the logits are a temporary nothing reads afterwards (their gradient needs only the softmax),
    so the forward works in their memory and leaves them holding the softmax.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp, ignore_index, overwrite)

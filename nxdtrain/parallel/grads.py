"""Gradient reductions between ranks, and the global gradient norm.

After the backward of all microbatches each rank holds the gradient of its own loss terms.
Three sums make them the gradient of the global-batch loss (four with sequence parallelism,
where step 0 sums the norm weights' gradients over tp: each rank saw only its sequence slice; also
without it for per-head q/k norms, of which each rank saw only its own heads):

1. K/V replicas (kv_size_multiplier > 1): the tp ranks holding the same K/V head each saw only
   their own Q heads; the sum over the replica group is the head's full gradient, and every
   replica applies it, so the copies stay identical.
2. Tied embeddings: ``lm_head.weight`` on the last stage is a copy of the embedding on the
   first; both get the sum of the two gradients.
3. Data parallel: the sum over dp ranks (the loss is already divided by the global token count). An MoE
   model's experts instead over the expert-data-parallel ranks (those holding the same experts: each expert's
   gradient already has every ep rank's tokens, sent to it by all-to-all).

The norm sums each distinct gradient element once: norm weights only on tp rank 0, a replicated
K/V head only on the first rank of its replica group, a tied lm_head not at all (its embedding
counts), summed over the model-parallel (tp x pp) group of one data-parallel replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Rows = slice


@dataclass
class GradPlan:
    """Which gradients this rank reduces with whom, and which rows it counts in the norm."""

    dp_group: Any = None
    mp_group: Any = None
    kv_group: Any = None
    kv_rows: list[tuple[str, Rows]] = field(default_factory=list)
    tied_group: Any = None          # first+last stage, when pp > 1
    tied_names: tuple[str, ...] = ()  # ("model.embed_tokens.weight",) on the first stage, lm_head on the last; both if pp == 1
    uncounted: dict[str, list[Rows]] = field(default_factory=dict)  # rows left out of the norm here (empty list: all)
    seq_group: Any = None           # tp group, with sequence parallelism
    seq_names: tuple[str, ...] = ()  # norm weights (SP) or per-head q/k norms: summed over seq_group
    expert_names: tuple[str, ...] = ()  # MoE: this ep rank's experts, summed over edp_group instead of dp_group
    edp_group: Any = None
    ep_group: Any = None            # the norm: the experts of the other ep ranks count too
    shard_group: Any = None         # --shard-params: the dp ranks holding the other rows (the norm sums over them)


def _all_reduce_flat(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in one collective per dtype (copied back in place)."""
    if group is None or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def reduce_gradients(grads: dict[str, torch.Tensor], plan: GradPlan) -> None:
    """Steps 0-3 of the module docstring, in place."""
    _all_reduce_flat([grads[name] for name in plan.seq_names], plan.seq_group)
    if plan.kv_group is not None:
        _all_reduce_flat([grads[name][rows] for name, rows in plan.kv_rows], plan.kv_group)
    if len(plan.tied_names) == 2:  # embedding and lm_head on this same rank
        embed, head = (grads[n] for n in plan.tied_names)
        embed.add_(head)
        head.copy_(embed)
    elif plan.tied_names and plan.tied_group is not None:
        _all_reduce_flat([grads[plan.tied_names[0]]], plan.tied_group)
    experts = set(plan.expert_names)
    _all_reduce_flat([g for name, g in grads.items() if name not in experts], plan.dp_group)
    _all_reduce_flat([grads[name] for name in plan.expert_names], plan.edp_group)


def _counted_parts(grad: torch.Tensor, skip: list[Rows] | None) -> list[torch.Tensor]:
    if skip is None:
        return [grad]
    if not skip:
        return []
    kept, start = [], 0
    for rows in sorted(skip, key=lambda r: r.start):
        if rows.start > start:
            kept.append(grad[start:rows.start])
        start = rows.stop
    if start < grad.shape[0]:
        kept.append(grad[start:])
    return kept


def global_norm(grads: dict[str, torch.Tensor], plan: GradPlan) -> torch.Tensor:
    """L2 norm of the whole model's gradient (each distinct element once), same value on every rank."""
    experts = set(plan.expert_names)
    squares = [part.float().pow(2).sum() for name, g in grads.items() if name not in experts
               for part in _counted_parts(g, plan.uncounted.get(name))]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if plan.expert_names:
        mine = torch.stack([grads[name].float().pow(2).sum() for name in plan.expert_names]).sum()
        if plan.ep_group is not None:
            dist.all_reduce(mine, group=plan.ep_group)
        total = total + mine.to(total.device)
    for group in (plan.mp_group, plan.shard_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_gradients(grads: dict[str, torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale by ``max_norm / (norm + 1e-6)`` when that is below 1 (torch's clip_grad_norm_ rule)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.dtype))

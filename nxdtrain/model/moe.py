"""The mixture-of-experts MLP of a sparse layer (Mixtral, Qwen3-MoE) on NxD's parameters, and the router's
auxiliary load-balancing loss.

Parameters, with NxD's names and this rank's shapes (ckptconv.core.families.moe): ``router.linear_router.weight``
``[E, H]`` (whole on every rank), ``expert_mlps.mlp_op.gate_up_proj.weight`` ``[E/ep, H, 2I/tp]`` (each expert's
last dim ``[gate_r | up_r]``) and ``expert_mlps.mlp_op.down_proj.weight`` ``[E/ep, I/tp, H]``. The routing is
ckptconv's (:func:`ckptconv.core.route_logits`: softmax in fp32, top-k, renormalized as the family's transformers
class does), the dispatch to the experts :func:`nxdtrain.parallel.experts.routed`.

The aux loss is transformers' ``load_balancing_loss_func`` over one micro-batch's forward
(``output_router_logits=True``): with ``C_e`` the top-k assignments to expert e and ``P_e`` the summed softmax
probabilities of e, both over every sparse layer and token of the micro-batch (``R`` rows in all),
``aux = E * sum_e C_e P_e / R^2``. Its gradient reaches the router through ``P`` only (``C`` counts), scaled by
``router_aux_loss_coef`` and divided by the global batch's micro-batches (averaged like the cross-entropy); it is
added in the backward by :class:`_AuxGrad` at each sparse layer (the same ``dP`` for every layer, computed once per
micro-batch), so that the schedules' loss stays the cross-entropy.
``C`` must be whole when the backward starts: at pp 1 the micro-batch's forward has counted every layer; at pp > 1
the counts travel with the micro-batch (:class:`_CarriedAuxGrad`): forward with the activations, each sparse layer
adding its own, so the last stage holds the whole ``C``; back with the gradients, in the place of that tensor's
gradient (:func:`with_counts`), so each layer's backward has the whole ``C`` without another forward. The counts are
integers (exact in fp32 whatever the order they are added in), so ``dP`` is the same as a sum over the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ckptconv.core import ModelSpec, route_logits
from nxdtrain.config.options import DataConfig
from nxdtrain.model.capacity import Routing, dropped_weights, kept, slots
from nxdtrain.model.grouped import grouped_mlp
from nxdtrain.parallel.experts import EpGroup, by_mask, routed
from nxdtrain.parallel.layers import TpGroup, enter_tp, leave_tp


@dataclass
class MicroBatch:
    """One micro-batch's router statistics on this stage: per sparse layer, its counts ``C`` and probability sums
    ``P`` (detached); ``counts``: every stage's ``C`` summed, come back with the gradients (pp > 1)."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    counts: torch.Tensor | None = None
    carried: torch.Tensor | None = None  # pp > 1, during the stage's forward: C of the sparse layers so far
    grad: torch.Tensor | None = None  # the aux loss's dP, the same for every sparse layer: computed once

    def stats(self, experts: int, device: torch.device) -> torch.Tensor:
        """``[2, E]``: this stage's C and P (zeros on a stage without sparse layers)."""
        out = torch.zeros(2, experts, device=device, dtype=torch.float32)
        for c, p in self.layers.values():
            out[0] += c
            out[1] += p
        return out

    def all_counts(self) -> torch.Tensor:
        if self.counts is not None:
            return self.counts
        return torch.stack([c for c, _ in self.layers.values()]).sum(0)


@dataclass
class AuxLoss:
    """The aux loss of one stage: ``coef`` (router_aux_loss_coef), the global batch's micro-batch count, the rows
    ``R`` of one micro-batch (sparse layers x tokens), and the micro-batches of the current step, in forward order."""

    experts: int
    top_k: int
    coef: float
    microbatches: int  # of the whole global batch (gbs / mbs)
    rows: int
    scale: float = 1.0  # 1 / top_k for NxD's load_balancing_loss_func (x E / top_k), 1 for transformers' (x E)
    inject: bool = True  # tp rank 0's gradient counts: the router logits' gather sums the tp ranks' gradients
    batches: list[MicroBatch] = field(default_factory=list)
    cursor: int = 0

    def next(self) -> MicroBatch:
        """The statistics of the micro-batch whose forward starts."""
        if self.cursor == len(self.batches):
            self.batches.append(MicroBatch())
        self.cursor += 1
        return self.batches[self.cursor - 1]

    def start_step(self) -> None:
        self.batches, self.cursor = [], 0

    def record(self, batch: MicroBatch, layer: int, logits: torch.Tensor) -> torch.Tensor:
        """Count a layer's routing as load_balancing_loss_func does (its own softmax and top-k); return its
        differentiable probability sums ``P`` ``[E]``."""
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts).float()
        sums = probs.float().reshape(-1, self.experts).sum(0)
        batch.layers[layer] = (counts, sums.detach())  # a recomputation writes the same values again
        return sums

    def gradient(self, batch: MicroBatch) -> torch.Tensor:
        """d(coef * aux / microbatches) / dP (zero on tp ranks > 0, whose gradients the gather adds to rank 0's),
        computed at the micro-batch's first sparse-layer backward, when its counts are whole."""
        if batch.grad is None:
            scale = self.coef / self.microbatches if self.inject else 0.0
            batch.grad = scale * self.scale * self.experts * batch.all_counts() / self.rows ** 2
        return batch.grad


class _AuxGrad(torch.autograd.Function):
    """Identity on the layer output; in the backward, the aux loss's gradient for the layer's ``P``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, sums: torch.Tensor, aux: AuxLoss, batch: MicroBatch) -> torch.Tensor:
        ctx.aux, ctx.batch = aux, batch
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        return grad, ctx.aux.gradient(ctx.batch), None, None


class _CarriedAuxGrad(torch.autograd.Function):
    """pp > 1: identity on the layer output, and ``carried + counts`` (the micro-batch's counts so far, sent on with
    the activations). The backward receives, in the place of that sum's gradient, the micro-batch's whole counts
    (:func:`with_counts` puts them there on the last stage), gives the layer's ``P`` the aux loss's gradient from
    them and passes them on to the layers and stages before."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, sums: torch.Tensor, carried: torch.Tensor, counts: torch.Tensor,
                aux: AuxLoss, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.aux, ctx.batch = aux, batch
        return out.view_as(out), carried + counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.batch.counts is None:
            ctx.batch.counts = total
        return grad, ctx.aux.gradient(ctx.batch), total, None, None, None


class _WithCounts(torch.autograd.Function):
    """The loss, unchanged; its backward sends the last stage's carried counts (then whole) back as their
    gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(carried)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (carried,) = ctx.saved_tensors
        return grad, carried


def with_counts(loss: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """The last stage's loss, whose backward starts the whole counts ``carried`` on their way back (pp > 1)."""
    out: torch.Tensor = _WithCounts.apply(loss, carried)
    return out


def step_aux(aux: AuxLoss, pp_group: Any, dp_group: Any, device: torch.device) -> torch.Tensor:
    """This step's aux loss, averaged over the global batch's micro-batches (the same value on every rank).
    Collective over the pipeline and data-parallel groups."""
    stats = torch.stack([b.stats(aux.experts, device) for b in aux.batches[:aux.cursor]])
    if pp_group is not None:
        dist.all_reduce(stats, group=pp_group)
    value = aux.scale * aux.experts * (stats[:, 0] * stats[:, 1]).sum() / aux.rows ** 2 / aux.microbatches
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
    return value


class _Weight(nn.Module):
    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype))  # overwritten from the shard


class _MlpOp(nn.Module):
    def __init__(self, local: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _Weight(local, hidden, 2 * inter, dtype=dtype)
        self.down_proj = _Weight(local, inter, hidden, dtype=dtype)


class _ExpertMlps(nn.Module):
    def __init__(self, local: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.mlp_op = _MlpOp(local, hidden, inter, dtype)


class _Router(nn.Module):
    def __init__(self, experts: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_router = _Weight(experts, hidden, dtype=dtype)


class SparseMLP(nn.Module):
    """The sparse block of decoder layer ``layer`` for tp rank ``tp.rank`` and ep rank ``ep.rank``."""

    def __init__(self, spec: ModelSpec, layer: int, tp: TpGroup, ep: EpGroup, *, dtype: torch.dtype,
                 routing: Routing | None = None) -> None:
        super().__init__()
        moe = spec.family.moe
        assert moe is not None
        self.layer, self.tp, self.ep = layer, tp, ep
        self.routing = routing or Routing(spec.top_k, moe.norm_topk(spec.config))
        self.experts, self.top_k = spec.experts, self.routing.top_k
        self.per_rank = spec.experts // ep.size
        self.normalize, self.cast_back = self.routing.normalize, moe.cast_topk
        self.router = _Router(spec.experts, spec.hidden, dtype)
        self.expert_mlps = _ExpertMlps(self.per_rank, spec.hidden, spec.expert_intermediate // tp.size, dtype)

    def forward(self, x: torch.Tensor, aux: AuxLoss | None = None, batch: MicroBatch | None = None) -> torch.Tensor:
        # The router on this rank's tokens (its sequence slice with SP), its logits gathered over tp: every tp rank
        # then routes every token alike, and the backward sums the tp ranks' partial gradients of the logits.
        logits = enter_tp(F.linear(x, self.router.linear_router.weight), self.tp)
        h = enter_tp(x, self.tp)
        flat = h.reshape(-1, h.shape[-1])
        weights, indices = route_logits(logits.reshape(-1, self.experts), self.top_k, normalize=self.normalize,
                                        cast_back=self.cast_back)
        if self.routing.capacity is not None:  # NxD's token dropping, over this rank's micro-batch (all tp alike)
            cap = slots(len(indices), self.top_k, self.experts, self.routing.capacity)
            keep = kept(indices, self.experts, cap, h.shape[0], self.routing.seq_major)
            weights = dropped_weights(weights, keep, self.normalize)
        op = self.expert_mlps.mlp_op
        gate_up, down = op.gate_up_proj.weight, op.down_proj.weight

        def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
            gate, up = (rows @ gate_up[e]).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ down[e]

        def grouped(rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            return grouped_mlp(rows, gate_up, down, sizes)

        def masked(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return by_mask(rows, ids, self.per_rank, expert)

        out = routed(flat, weights, indices, self.ep, self.per_rank, grouped,
                     masked if flat.device.type == "xla" else None)
        out = leave_tp(out.view_as(h), self.tp)
        if aux is not None and batch is not None:
            sums = aux.record(batch, self.layer, logits)
            # On every tp rank (a zero gradient on ranks > 0): the same autograd graph on each, so that their
            # backward runs the tp collectives in the same order.
            if aux.coef and torch.is_grad_enabled():
                if batch.carried is None:
                    out = _AuxGrad.apply(out, sums, aux, batch)
                else:
                    out, batch.carried = _CarriedAuxGrad.apply(out, sums, batch.carried, batch.layers[self.layer][0],
                                                               aux, batch)
        return out


def aux_loss(spec: ModelSpec, data: DataConfig, *, inject: bool, routing: Routing | None = None) -> AuxLoss | None:
    """The router's aux loss of an MoE run over ``data``'s micro-batches (``inject``: this rank adds its gradient,
    tp rank 0); None for a dense model or a run without it (``--no-output-router-logits``)."""
    if not spec.experts:
        return None
    moe = spec.family.moe
    assert moe is not None
    # without a routing: config.json's coefficient, else transformers' default (MixtralConfig, Qwen3MoeConfig)
    routing = routing or Routing(spec.top_k, moe.norm_topk(spec.config),
                                 coef=float(spec.config.get("router_aux_loss_coef", 0.001)))
    if not routing.aux:
        return None
    sparse = sum(1 for layer in range(spec.layers) if spec.sparse(layer))
    return AuxLoss(spec.experts, routing.top_k, routing.coef, microbatches=data.gbs // data.mbs,
                   rows=sparse * data.mbs * data.seq_len, scale=1 / routing.top_k if routing.aux_per_k else 1.0,
                   inject=inject)

"""How an MoE run routes: experts per token, renormalization, NxD's capacity-factor token dropping, and the aux
loss's definition, from ``--capacity-factor`` & co. (an NxDT YAML's ``model.moe``) over the checkpoint's config.json.

Token dropping is NxD's ``ExpertMLPsV2.forward_capacity_factor`` (neuronx-distributed 2.26): with ``T`` the tokens of
this data-parallel rank's micro-batch (all of them on every tp rank, before any expert-parallel exchange), each expert
keeps at most ``C = min(T, ceil(T * top_k * F / E))`` (token, expert) slots, the first in token order; the weights of
the kept slots are renormalized over the kept ones (a token whose every slot is dropped adds nothing). The token order
is NxDT's flattening: ``s * B + b`` with sequence parallel (its hidden states are ``(S, B, H)``), else ``b * S + s``.
``F >= E / top_k`` is NxD's full capacity: no dropping, the dropless path unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ckptconv.core import ModelSpec
from nxdtrain.config.options import MoeConfig, TrainConfig, explain
from nxdtrain.errors import TrainError

# transformers' MixtralConfig / Qwen3MoeConfig default where config.json states no router_aux_loss_coef
TRANSFORMERS_AUX_COEF = 0.001


@dataclass(frozen=True)
class Routing:
    """The routing of an MoE run. ``capacity``: NxD's capacity factor when it drops tokens (0 < F < E / top_k), else
    None; ``seq_major``: count tokens in NxDT's sequence-parallel order; ``aux_per_k``: NxD's aux loss (x E / top_k)."""

    top_k: int
    normalize: bool
    capacity: float | None = None
    seq_major: bool = False
    coef: float = TRANSFORMERS_AUX_COEF
    aux: bool = True
    aux_per_k: bool = False


def routing(spec: ModelSpec, moe: MoeConfig, *, sequence_parallel: bool) -> tuple[Routing, list[str]]:
    """The run's routing and lines saying where it differs from config.json; raise TrainError where the checkpoint
    cannot do what was asked (one line naming both values)."""
    family = spec.family.moe
    assert family is not None
    notes = []
    if moe.num_experts is not None and moe.num_experts != spec.experts:
        raise TrainError(f"--num-experts {moe.num_experts}: the checkpoint's "
                         f"config.json has {spec.experts} experts; set it to {spec.experts}")
    top_k = spec.top_k if moe.moe_top_k is None else moe.moe_top_k
    if top_k > spec.experts:
        raise TrainError(f"--moe-top-k {top_k} exceeds the checkpoint's {spec.experts} experts")
    if top_k != spec.top_k:
        notes.append(f"--moe-top-k {top_k}: each token goes to {top_k} experts (config.json's num_experts_per_tok: "
                     f"{spec.top_k})")
    normalize = family.norm_topk(spec.config)
    if moe.normalize_top_k_affinities is not None and moe.normalize_top_k_affinities != normalize:
        normalize = moe.normalize_top_k_affinities
        notes.append(f"--{'' if normalize else 'no-'}normalize-top-k-affinities: the kept experts' weights are "
                     f"{'' if normalize else 'not '}renormalized (the checkpoint's family does "
                     f"{'not ' if normalize else ''}renormalize)")
    if normalize and top_k == 1 and moe.normalize_top_k_affinities:  # NxD's validate_routed_experts_configs
        raise TrainError("--normalize-top-k-affinities with top_k 1: NxD refuses it (every weight would be 1); "
                         "give top_k > 1 or --no-normalize-top-k-affinities")
    recorded = spec.config.get("router_aux_loss_coef")
    coef = float(moe.router_aux_loss_coef if moe.router_aux_loss_coef is not None else
                 recorded if recorded is not None else TRANSFORMERS_AUX_COEF)
    if moe.router_aux_loss_coef is not None and recorded is not None and float(recorded) != coef:
        notes.append(f"--router-aux-loss-coef {coef:g} (config.json's router_aux_loss_coef: {float(recorded):g})")
    cf = moe.capacity_factor
    dropping = cf is not None and 0 < cf < spec.experts / top_k
    if dropping:
        notes.append(f"--capacity-factor {cf:g}: each expert takes at most ceil(T x {top_k} x {cf:g} / "
                     f"{spec.experts}) of a micro-batch's T tokens, the rest of its slots dropped (NxD's "
                     f"forward_capacity_factor)")
    elif cf:
        notes.append(f"--capacity-factor {cf:g} >= E / top_k = {spec.experts / top_k:g}: full capacity, no token "
                     "dropped (NxD's rule)")
    if not moe.output_router_logits:
        notes.append("--no-output-router-logits: trained without the router's aux loss")
    elif moe.aux_loss_scale == "nxd":
        notes.append(f"--aux-loss-scale nxd: the aux loss is NxD's load_balancing_loss_func, transformers' / top_k "
                     f"({top_k})")
    return Routing(top_k, normalize, cf if dropping else None, seq_major=sequence_parallel, coef=coef,
                   aux=moe.output_router_logits, aux_per_k=moe.aux_loss_scale == "nxd"), notes


def slots(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """NxD's expert capacity: ``min(T, ceil(T * top_k * F / E))`` in Python floats."""
    return min(tokens, math.ceil(tokens * top_k * factor / experts))


def kept(indices: torch.Tensor, experts: int, capacity: int, batch: int, seq_major: bool) -> torch.Tensor:
    """``(T, k)`` bool: the (token, slot) assignments NxD keeps. ``indices`` ``(B * S, k)`` in ``b * S + s`` order;
    the count runs over ``s * B + b`` when ``seq_major`` (NxDT with sequence parallel)."""
    tokens, k = indices.shape
    order = indices.view(batch, -1, k).transpose(0, 1).reshape(tokens, k) if seq_major else indices
    hot = torch.zeros(tokens, experts, dtype=torch.int64, device=indices.device).scatter_(1, order, 1)
    position = torch.cumsum(hot, dim=0).gather(1, order)  # 1-based rank of this token among the expert's
    keep = position <= capacity
    return keep.view(-1, batch, k).transpose(0, 1).reshape(tokens, k) if seq_major else keep


def dropped_weights(weights: torch.Tensor, keep: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The dropped slots' weights zeroed, the kept ones renormalized over the kept (NxD's
    get_expert_affinities_masked: an L1 normalization with eps 1e-12)."""
    masked = weights * keep.to(weights.dtype)
    if not normalize:
        return masked
    return masked / masked.abs().sum(-1, keepdim=True).clamp_min(1e-12)


def run_routing(spec: ModelSpec, config: TrainConfig | None) -> tuple[Routing | None, list[str]]:
    """:func:`routing` of ``config`` (None: no MoE option given); None for a dense model, where an MoE option given
    is refused."""
    moe = config.moe if config is not None else MoeConfig()
    if not spec.experts:
        given = sorted(f.name for f in dataclasses.fields(moe) if getattr(moe, f.name) != f.default)
        if given:
            raise TrainError(f"--{given[0].replace('_', '-')}: an MoE option, and the checkpoint has no experts")
        return None, []
    sp = config is not None and config.parallel.sequence_parallel
    origins = config.origins if config is not None else {}
    try:  # the YAML key of a value from an NxDT file, instead of the flag
        found, notes = routing(spec, moe, sequence_parallel=sp)
    except TrainError as exc:
        raise TrainError(explain(str(exc), origins)) from None
    return found, [explain(n, origins) for n in notes]

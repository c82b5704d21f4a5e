"""Qwen3-MoE through TorchTitan: what ``to-dcp`` says about ``expert_bias_E``, and what ``from-dcp`` does with it.

TorchTitan (pinned: :data:`~ckptconv.titan.names.TITAN_VERSION`) balances its experts without an auxiliary loss: a
persistent fp32 buffer ``layers.N.moe.expert_bias_E`` is added to the router scores when choosing the top-k experts
(not to their weights) and updated after each optimizer step. A full load requires it, HF's Qwen3-MoE has none:
``to-dcp`` writes zeros (routing is then exactly the source's), ``from-dcp`` drops zeros and refuses a trained bias
(the model it would write routes differently), unless told to drop it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError
from ckptconv.titan.names import MOE_BIAS, moe_layers, titan_params

DROP_FLAG = "--drop-expert-bias"


def bias_carried(spec: ModelSpec) -> bool:
    """Whether ``expert_bias_E`` is an HF tensor of the family (DeepSeek-V3's ``e_score_correction_bias``), carried
    both ways like any weight, rather than zeros HF has no place for."""
    return any(p.buffer and not all(piece.zeros for piece in p.pieces) for p in titan_params(spec))


def bias_note(spec: ModelSpec) -> list[str]:
    """The one note ``to-dcp`` gives a mixture of experts (none for a dense model, or one whose bias is carried)."""
    sparse = len(moe_layers(spec))
    if not sparse or bias_carried(spec):
        return []
    aux = spec.config.get("router_aux_loss_coef")
    return [f"expert_bias_E of the {sparse} sparse layer(s) written as zeros (fp32, no optimizer state; the router "
            "then picks the source's experts): TorchTitan's auxiliary-loss-free bias balancing (load_balance_coeff "
            "1e-3 in torchtitan_config.py) replaces the source's router aux loss"
            + (f" (router_aux_loss_coef {aux!r})" if aux is not None else "")]


def experts(spec: ModelSpec) -> int:
    """Routed experts per MoE layer (GPT-OSS states them outside the MoE seam: its router's rows)."""
    return spec.experts or int(spec.config.get("num_local_experts") or 0)


def check_expert_bias(read_rows: Callable[[Source, int, int], torch.Tensor], keys: Collection[str], spec: ModelSpec,
                      where: str, *, drop: bool) -> list[str]:
    """Each sparse layer's ``expert_bias_E`` (of ``keys``: a run with ``load_balance_coeff`` None saves none) has no
    HF counterpart: zeros are dropped (said), a trained bias is refused naming the layer and its largest value unless
    ``drop`` (then said, with that value). A bias the family carries (:func:`bias_carried`) is not checked here."""
    if bias_carried(spec):
        return []
    largest, first = 0.0, ""
    layers = moe_layers(spec)
    for n in layers:
        if MOE_BIAS.format(n) in keys:
            key = MOE_BIAS.format(n)
            value = read_rows(Source(None, key), 0, experts(spec)).abs().max().item()
            first = first or (key if value else "")
            largest = max(largest, value)
    if not layers:
        return []
    if largest and not drop:
        raise ConversionError(f"{where}: {first!r} is not zero (largest |expert_bias_E| {largest:.3g}): TorchTitan's "
                              f"load balancing trained a routing bias that HF's {spec.family.name} has no place for, so the "
                              f"model written would route differently; pass {DROP_FLAG} to write it without the bias")
    if largest:
        return [f"dropped the trained expert_bias_E ({DROP_FLAG}; largest |value| {largest:.3g}): the model written "
                "routes without TorchTitan's balancing bias"]
    if not any(MOE_BIAS.format(n) in keys for n in layers):
        return ["no expert_bias_E (a run without TorchTitan's load balancing): no routing bias to carry"]
    return ["expert_bias_E: zeros in every sparse layer (no routing bias to carry), dropped"]

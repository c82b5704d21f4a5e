"""What the trainer calls for ``--shard-params`` / ``--hybrid-shard N`` (:mod:`nxdtrain.parallel.fsdp`), importing
torch's FSDP and DTensor (a second at start) only when a run shards its parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdtrain.config.checks import shard_degree
from nxdtrain.parallel.grads import GradPlan
from nxdtrain.parallel.offload import NO_EFFECT as OFFLOAD_NO_EFFECT

if TYPE_CHECKING:
    from nxdtrain.parallel.fsdp import Sharding


def sharding_for(model: nn.Module, config: Any, mesh: Any, device: torch.device) -> Sharding | None:
    """``model`` wrapped by FSDP2 as the run's options ask (None: parameters not sharded); ``mesh``: nxdtrain's Mesh.
    Collective."""
    par = config.parallel
    degree = shard_degree(shard_params=par.shard_params, hybrid_shard=par.hybrid_shard, dp=mesh.dp)
    if degree is None:
        return None
    from nxdtrain.parallel.fsdp import shard_stage

    return shard_stage(model, mesh, device_type=device.type, degree=degree, bf16=config.precision == "bf16")


def on_local_rows(plan: GradPlan, sharding: Sharding | None, model: nn.Module) -> GradPlan:
    """``plan`` (:func:`nxdtrain.model.stage.grad_plan`) for this rank's rows (:meth:`Sharding.local_plan`)."""
    return plan if sharding is None else sharding.local_plan(plan, dict(model.named_parameters()))


def local_all(tensors: dict[str, torch.Tensor], sharding: Sharding | None) -> dict[str, torch.Tensor]:
    """This rank's rows of each tensor (views: in-place changes reach the DTensors); as they are when not sharded."""
    if sharding is None:
        return tensors
    from nxdtrain.parallel.fsdp import local

    return {name: local(t) for name, t in tensors.items()}


def memory_notes(sharding: Sharding | None, config: Any, dp: int, device: torch.device) -> list[str]:
    """What rank 0 says at the start about sharding and offloading."""
    lines = []
    if sharding is not None:
        how = "fully sharded" if sharding.degree == dp else f"hybrid: {dp // sharding.degree} replicas"
        lines.append(f"parameters, gradients and optimizer state sharded over {sharding.degree} data-parallel "
                     f"rank{'s' if sharding.degree > 1 else ''} (FSDP2, {how}); tags hold whole per-tp-rank shards, "
                     "gathered at each save")
    if config.parallel.offload_activations and device.type == "cpu":
        lines.append(OFFLOAD_NO_EFFECT)
    return lines


def state_bytes(model: nn.Module, optimizer: Any, sharding: Sharding | None) -> dict[str, int]:
    """Bytes this rank holds of parameters (and fp32 masters), gradients and optimizer state: local parts only.
    Call between the backward and ``zero_grad`` (when the gradients exist)."""
    def size(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = list(model.parameters())
    masters = [] if not optimizer.mixed else list(optimizer.master.values())
    grads = [p.grad for p in (*params, *masters) if p.grad is not None]
    states = [t for s in optimizer._local().state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def total(tensors: list[Any]) -> int:
        return sum(map(size, local_all({str(i): t for i, t in enumerate(tensors)}, sharding).values()))

    return {"params": total([*params, *masters]), "grads": total(grads), "optimizer": total(states)}

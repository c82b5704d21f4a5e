"""Parameters, gradients and optimizer state sharded over data parallel with torch's FSDP2 (``--shard-params``,
``--hybrid-shard N``).

Each tp rank's stage (its NxD-named slices, as without sharding) is wrapped by ``fully_shard`` over a
``DeviceMesh`` of its data-parallel ranks (on the run's own dp group): one unit per decoder layer and the root
(embedding, final norm, lm_head). With ``--hybrid-shard N`` the mesh is 2-D, (dp / N replicas, N shards): dp ranks ``k·N .. k·N + N - 1``
share one copy. Every parameter is then a DTensor whose local part is this rank's rows (dim 0, ``torch.chunk``
order); FSDP all-gathers a unit's parameters for its forward and backward and reduce-scatters its gradients
(summed, not averaged: nxdtrain's loss is already divided by the global token count; all-reduced over the
replicas with hybrid sharding). The rest of the step works on the local rows: the K/V-replica, tied-embedding
and sequence-parallel sums of :mod:`nxdtrain.parallel.grads` (every tp rank of a dp rank holds the same rows of
its slice), the norm (summed over the shard group too), clipping and the optimizer, whose state is DTensors.

bf16 (``--precision bf16``): the sharded parameters are the fp32 masters; ``MixedPrecisionPolicy`` casts them
to bf16 for the forward and backward and reduces gradients in fp32.

A tag holds whole per-tp-rank shards as without sharding: at a save every rank of the first replica writes its rows
into the files dp rank 0 created (:mod:`nxdtrain.checkpoint.shared`; no gather but of the column-major records);
``--xser`` gathers each tensor over the dp mesh (:meth:`Sharding.gathered`), kept by dp rank 0, which writes it. A resume reads whole per-tp-rank tensors (any
tag: sharded or not, ZeRO-1, another dp or tp through the reshard-on-load) and each rank keeps its rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckptconv.training import MASTER, state_key
from nxdtrain.parallel.grads import GradPlan, Rows

if TYPE_CHECKING:
    from nxdtrain.parallel.dist import Mesh


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: in-place changes reach it); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dp_mesh(device_type: str, mesh: Mesh, degree: int) -> DeviceMesh:
    """This rank's data-parallel mesh: 1-D over its dp group, or 2-D (replicate, shard) with ``degree`` < dp.
    Built on ``mesh``'s own process groups (:meth:`Mesh.shard_groups`): ``init_device_mesh`` would create a
    second dp group and a tp group beside the run's (more communicators; on GPU, more NCCL buffers). Collective."""
    rows, groups = mesh.shard_groups(degree)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=("shard",))
    return DeviceMesh.from_group(groups, device_type, torch.tensor(rows), mesh_dim_names=("replicate", "shard"))


@dataclasses.dataclass
class Sharding:
    """One rank's FSDP wiring: the mesh, its shard dimension's group and this rank's place in it."""

    mesh: DeviceMesh
    degree: int
    bf16: bool

    @property
    def shard_group(self) -> Any:
        return self.mesh.get_group("shard")

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank("shard")

    @property
    def replica(self) -> int:
        """Which copy this rank holds rows of (0 without hybrid sharding)."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh.get_local_rank("replicate") if "replicate" in names else 0

    def rows(self, total: int) -> tuple[int, int]:
        """The rows [start, stop) of a ``total``-row tensor this rank holds (torch.chunk's split, as FSDP2's)."""
        chunk = math.ceil(total / self.degree)
        start = min(self.shard_rank * chunk, total)
        return start, min(start + chunk, total)

    def local_rows(self, name: str, param: torch.Tensor, rows: Rows) -> Rows | None:
        """``rows`` of the whole per-tp-rank tensor as rows of this rank's part (None: it holds none of them)."""
        start, stop = self.rows(param.shape[0])
        assert local(param).shape[0] == stop - start, (name, param.shape, local(param).shape, start, stop)
        lo, hi = max(rows.start, start), min(rows.stop, stop)
        return slice(lo - start, hi - start) if lo < hi else None

    def local_plan(self, plan: GradPlan, params: dict[str, torch.Tensor]) -> GradPlan:
        """``plan`` on the local rows: FSDP has summed over dp; the norm is summed over the shard group too."""
        kv_rows = [(name, part) for name, rows in plan.kv_rows
                   if (part := self.local_rows(name, params[name], rows)) is not None]
        uncounted: dict[str, list[Rows]] = {}
        for name, skipped in plan.uncounted.items():
            if not skipped:  # [] is "none of it counts", on every part
                uncounted[name] = []
                continue
            parts = [part for rows in skipped if (part := self.local_rows(name, params[name], rows)) is not None]
            if parts:  # no part skipped here: the key stays out (an empty list would skip the whole part)
                uncounted[name] = parts
        return dataclasses.replace(plan, dp_group=None, shard_group=self.shard_group, kv_rows=kv_rows,
                                   uncounted=uncounted)

    def reader(self, read: Callable[[str, str | None], dict[str, torch.Tensor]],
               params: Mapping[str, torch.Tensor]) -> Callable[[str, str | None], dict[str, torch.Tensor]]:
        """A tag's optimizer reader (whole per-tp-rank tensors) whose tensors of a parameter's shape come back as
        DTensors laid out like it (this rank's rows, from its own copy: no communication)."""
        def sharded(name: str, only: str | None) -> dict[str, torch.Tensor]:
            p = params[name]
            assert isinstance(p, DTensor)
            return {c: distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    if t.shape == p.shape else t for c, t in read(name, only).items()}

        return sharded

    def gathered(self, model: Any, optimizer: Any, *, keep: bool) -> tuple[Any, Any]:
        """The stage and optimizer as a tag writer reads them, with whole per-tp-rank tensors (gathered over the dp
        mesh one tensor at a time; ``keep``: this rank writes them, the others drop each one as it arrives).
        Collective over the world: every rank calls it in the same order."""
        weights = _full(model.state_dict().items(), keep)
        state = _full(optimizer.state_dict().items(), keep)
        if self.bf16:  # the sharded parameters are the fp32 masters, already gathered above as the weights;
            # the tag holds bf16 weights beside them (only the keeping rank has anything to keep)
            state.update({state_key(n, MASTER): weights[n] for n in optimizer.names} if keep else {})
            weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
        return _SavedStage(model, weights), _SavedOptimizer(state)


def _full(items: Iterable[tuple[str, Any]], keep: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in items:
        if isinstance(value, DTensor):
            value = value.full_tensor()  # collective over the mesh
        if keep:
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    return out


class _SavedStage:
    """What :class:`nxdtrain.checkpoint.save.TagWriter` reads of a stage, whole per tp rank."""

    def __init__(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        self._model, self._state = model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def shard_state(self) -> dict[str, torch.Tensor]:
        return self._model.shard_state(self._state)  # type: ignore[no-any-return]

    def records(self) -> Any:
        return self._model.records()

    def file_records(self) -> Any:  # what a device-resident stage is saved by (checkpoint.save._device_shard)
        return self._model.file_records()


class _SavedOptimizer:
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def shard_stage(model: nn.Module, mesh: Mesh, *, device_type: str, degree: int, bf16: bool) -> Sharding:
    """Wrap ``model`` (a :class:`nxdtrain.model.stage.LlamaStage`, loaded) with ``fully_shard`` over ``mesh``'s dp ranks
    (:func:`dp_mesh`): each decoder layer, then the root. Collective (at hybrid sharding, the groups it makes)."""
    device_mesh = dp_mesh(device_type, mesh, degree)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    layers = model.model.layers  # type: ignore[union-attr]
    for layer in layers.values():  # type: ignore[operator]
        fully_shard(layer, mesh=device_mesh, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # per unit: the setting is not inherited
            module.set_gradient_divide_factor(1.0)  # a sum: the loss is divided by the global token count already
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    assert all(isinstance(p, DTensor) and p.placements[-1] == Shard(0) for p in model.parameters())
    return Sharding(device_mesh, degree, bf16)

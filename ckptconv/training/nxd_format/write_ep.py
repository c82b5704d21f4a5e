"""Writing NxD's own expert-parallel ZeRO-1 optimizer files (``NeuronEPZero1Optimizer.state_dict()``).

From neuronx-distributed's source (``optimizer/zero_redundancy_optimizer.py``, ``parallel_layers/parallel_state.py``,
``trainer/checkpoint.py``; docs/nxd-optimizer-format.md, "NxD's own format at ep > 1"): at ep > 1 NxD's trainer
builds a ``NeuronEPZero1Optimizer``, two ``NeuronZero1Optimizer``s over the same param groups filtered (empty
groups kept): the non-expert parameters ZeRO-1-sharded over all dp ranks, the expert ones (``expert_model_parallel``:
the stacked ``[E/ep, ...]`` slabs of the rank's ep rank) over its expert-data-parallel group. Each chunks dim 0 as
at ep 1 (for an expert slab: whole experts, zero rows past the end). Its ``state_dict()`` is the non-expert one's
with the expert one's merged in at offsets, and no ``sharded_master_weights``. One file per global dp rank
``d = dp_exp_rank * ep + ep_rank``, named without ep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptconv.core.layout import ShardId
from ckptconv.core.plan import NESTED_TORCH, OutFile
from ckptconv.errors import ConversionError
from ckptconv.training.ep import check_zero1_ep, expert_data_rank, optimizer_ep_rank
from ckptconv.training.nxd_format.files import ep_offset
from ckptconv.training.nxd_format.write import (
    NxdOptimizerPlan,
    Zero1File,
    checked_state,
    group_hyper,
    index_order,
    note_drop_masters,
    note_unwritten,
    numbered_groups,
    nxd_groups,
    unwritten_fields,
)
from ckptconv.training.nxdtrain_format.placement import ep_stages, optimizer_file
from ckptconv.training.nxdtrain_format.state import MASTER, OptimizerSource


class _Part:
    """The parameters one of the two ZeRO-1 optimizers holds on a (tp, pp) rank: names in NxD's index order, their
    planned weights and state, the group size they are chunked over."""

    def __init__(self, shard: OutFile, names: list[str], rule: str, optim: OptimizerSource, world: int) -> None:
        self.shard, self.world = shard, world
        self.weights = {t.key: t for t in shard.tensors if t.key in names}
        self.groups = nxd_groups([n for n in names if n in self.weights], rule)
        self.order = [n for g in self.groups for n in g]
        self.state = checked_state(shard.path, self.weights, self.order, optim)


def plan_nxd_ep_optimizer_files(shards: Sequence[OutFile], optim: OptimizerSource, *, dp: int, zero1: bool, rule: str,
                                drop_masters: bool, lr: tuple[float, float] | None,
                                notes: list[str]) -> tuple[list[OutFile], NxdOptimizerPlan]:
    """NxD's EP ZeRO-1 optimizer files for the expert-parallel target shards ``shards`` (their names carry the ep
    rank; an ep rank > 0's shard holds its experts only). ``lr`` as for
    :func:`ckptconv.training.nxd_format.write.plan_nxd_optimizer_files`. The source's masters cannot be
    carried (NxD's EP files hold none): refused unless ``drop_masters``."""
    stages, ep = ep_stages(shards)
    if not zero1:
        raise ConversionError(f"--optimizer-format nxd at ep {ep} without ZeRO-1: NxD's per-ep-rank AdamW files "
                              "(optim/dp_rank_00_ep_rank_EE_...) are not written; pass --zero1")
    check_zero1_ep(dp, ep)
    out: list[OutFile] = []
    names_of: dict[ShardId, list[str]] = {}
    dtypes: set[str] = set()
    masters: list[str] = []
    unwritten: set[str] = set()
    for (tp, pp), by_ep in sorted(stages.items()):
        experts = {t.key for e, shard in by_ep.items() if e > 0 for t in shard.tensors}
        ordered = index_order(by_ep[0], "one")  # the shard's parameters in live order (inv_freq left out)
        dense = _Part(by_ep[0], [n for n in ordered if n not in experts], rule, optim, dp)
        parts = [_Part(by_ep[e], [n for n in ordered if n in experts], rule, optim, dp // ep) for e in range(ep)]
        hypers = _hypers(dense, parts[0], optim, rule)
        unwritten |= unwritten_fields(hypers)
        groups = [*numbered_groups(hypers, dense.groups, zero1=True, lr=lr),
                  *numbered_groups(hypers, parts[0].groups, zero1=True, lr=lr)]
        names_of[by_ep[0].shard_id] = dense.order + parts[0].order
        for e in range(1, ep):
            names_of[by_ep[e].shard_id] = parts[e].order
        masters += [n for part in (dense, *parts) for n in part.order if MASTER in part.state[n]]
        for d in range(dp):
            e = optimizer_ep_rank(d, ep)
            path = optimizer_file(tp_rank=tp, pp_rank=pp, dp_rank=d)
            out.append(_file(path, dense, parts[e], d, expert_data_rank(d, ep), groups, optim, dtypes))
    if masters and not drop_masters:
        raise ConversionError(f"{masters[0]!r}: NxD's expert-parallel ZeRO-1 files hold no master weights "
                              "(NeuronEPZero1Optimizer's state_dict drops them): pass --drop-masters to write the "
                              "moments without the source's masters")
    if drop_masters:  # as at ep 1: what --drop-masters did is said, also when the source saved no masters
        note_drop_masters(notes, dropped=bool(masters), kept="the source saved no master weights")
    note_unwritten(unwritten, notes)
    notes.append(f"NxD's expert-parallel ZeRO-1 state (NeuronEPZero1Optimizer): non-expert parameters over dp {dp}, "
                 f"each ep rank's experts over its {dp // ep} expert-data-parallel ranks; no master weights")
    plan = NxdOptimizerPlan(rule, True, dp, "none", "/".join(sorted(dtypes)), names_of)
    return out, plan


def _hypers(dense: _Part, experts: _Part, optim: OptimizerSource, rule: str) -> list[dict[str, Any]]:
    """Group ``g``'s hyper-parameters, shared by both optimizers (the same groups filtered): those of its members
    in either."""
    shapes = {**{n: t.shape for n, t in dense.weights.items()}, **{n: t.shape for n, t in experts.weights.items()}}
    return [group_hyper(dense.groups[g] + experts.groups[g], shapes, optim.hyper.param_groups, g, rule)
            for g in range(len(dense.groups))]


def _file(path: str, dense: _Part, experts: _Part, dp_rank: int, edp_rank: int, param_groups: list[dict[str, Any]],
          optim: OptimizerSource, dtypes: set[str]) -> OutFile:
    """One dp rank's file: ``dp_rank``'s chunk of the non-expert state, ``edp_rank``'s of its ep rank's experts."""
    z = Zero1File()
    offset = ep_offset(len(dense.order))
    for part, rank, first in ((dense, dp_rank, 0), (experts, edp_rank, offset)):
        for j, name in enumerate(part.order):
            z.add(first + j, name, part.weights[name], part.state[name], optim, world=part.world, rank=rank,
                  shard_path=part.shard.path, dtypes=dtypes)
    plain: tuple[tuple[str, Any], ...] = (
        ("ep_param_id_offset", 1), ("ep_param_group_offset", len(dense.groups)), ("ep_base_state_offset", offset),
        ("ep_shape_info_offset", offset), ("param_groups", param_groups), ("state", {}), ("base_state", z.base_state),
        ("shape_info", z.shape_info))
    return OutFile(path, NESTED_TORCH, tuple(z.tensors), plain)


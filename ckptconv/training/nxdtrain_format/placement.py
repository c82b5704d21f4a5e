"""Where a parameter's optimizer state is saved in nxdtrain's format-2 files: the ZeRO-1 partition of a stage's
parameters over dp ranks, the file names, and (expert parallelism) which dp rank's file holds which ep rank's
experts (the ep arithmetic: :mod:`ckptconv.training.ep`). No I/O: the files are planned (:func:`optimizer_files`) and written by the executor.

    >>> zero1_partition([[("a", 6), ("b", 4), ("c", 4)], [("n", 1)]], 2)
    [[['a'], ['n']], [['b', 'c'], []]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ckptconv.core.layout import shard_name
from ckptconv.core.plan import OutFile, OutTensor
from ckptconv.io.tags import OPTIM_DIR
from ckptconv.training.ep import check_zero1_ep, expert_data_rank, optimizer_ep_rank

FORMAT = 2


def is_matrix(shape: Sequence[int]) -> bool:
    """Group 0 (weight decay) holds matrices, group 1 vectors: nxdtrain's param_groups rule."""
    return len(shape) >= 2


def zero1_partition(groups: Sequence[Sequence[tuple[str, int]]], world: int) -> list[list[list[str]]]:
    """Names per dp rank per param group, as torch's ZeroRedundancyOptimizer assigns parameters.

    Its rule (torch/distributed/optim/zero_redundancy_optimizer.py, ``_partition_parameters``): group by
    group, parameters sorted by size (largest first, stable), each to the rank with the fewest elements so
    far (the lowest such rank), sizes carried over from group to group.
    """
    sizes = [0] * world
    out: list[list[list[str]]] = [[[] for _ in groups] for _ in range(world)]
    for g, group in enumerate(groups):
        for name, numel in sorted(group, key=lambda item: item[1], reverse=True):
            rank = sizes.index(min(sizes))
            out[rank][g].append(name)
            sizes[rank] += numel
    return out


def stage_groups(names: Sequence[str], shapes: Mapping[str, Sequence[int]]) -> list[list[tuple[str, int]]]:
    """(name, numel) of the stage's parameters in group 0 (matrices) and group 1 (vectors), in ``names`` order."""
    def numel(name: str) -> int:
        return int(torch.Size(shapes[name]).numel())

    return [[(n, numel(n)) for n in names if is_matrix(shapes[n])],
            [(n, numel(n)) for n in names if not is_matrix(shapes[n])]]


def ep_stages(shards: Sequence[OutFile]) -> tuple[dict[tuple[int, int], dict[int, OutFile]], int]:
    """The model shards by (tp, pp) stage and ep rank (ep rank 0 for names without one), in ``shards`` order, and
    the ep degree they make up."""
    stages: dict[tuple[int, int], dict[int, OutFile]] = {}
    for shard in shards:
        ranks = shard.shard_id
        stages.setdefault((ranks.tp, ranks.pp), {})[ranks.ep] = shard
    return stages, 1 + max((e for stage in stages.values() for e in stage), default=0)


def optimizer_file(*, tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"{OPTIM_DIR}/{shard_name(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)}"


StateOf = Callable[[str, OutTensor], Mapping[str, OutTensor]]


def optimizer_files(shards: Sequence[OutFile], state_of: StateOf, param_groups: list[dict[str, Any]], *, dp: int,
                    zero1: bool) -> list[OutFile]:
    """Format-2 optimizer files for ``shards``; ``state_of(shard path, weight)`` plans a parameter's optimizer
    tensors by component (keyed :func:`state_key`), wherever they are read from (a tag, a TorchTitan checkpoint).

    Expert-parallel shards (``ep_rank`` in their names) get NxD's placement: a file per dp rank without an ep field,
    dp rank ``d`` holding the non-expert state ZeRO-1-partitioned over all ``dp`` ranks and the state of ep rank
    ``d % ep``'s experts partitioned over its ``dp / ep`` expert-data-parallel ranks (without ZeRO-1: ep rank e's
    experts in dp rank e's file, the rest in dp rank 0's)."""
    stages, ep = ep_stages(shards)
    if zero1:
        check_zero1_ep(dp, ep)
    out = []
    for (tp, pp), by_ep in stages.items():
        experts = {t.key for e, shard in by_ep.items() if e > 0 for t in shard.tensors}  # an ep rank > 0: experts only
        parts = [_Part(by_ep[0], experts, False, dp if zero1 else 1)]
        parts += [_Part(by_ep[e], experts, True, dp // ep if zero1 else 1) for e in range(ep) if ep > 1]
        for dp_rank in range(dp if zero1 else ep):
            ep_rank, local = optimizer_ep_rank(dp_rank, ep), expert_data_rank(dp_rank, ep)
            mine = [parts[0]] + ([parts[1 + ep_rank]] if ep > 1 else [])
            held = [(part, part.owned(dp_rank if i == 0 else local)) for i, part in enumerate(mine)]
            names = [n for part in mine for n in part.names]
            owned = [n for _, of in held for n in of]
            plain: tuple[tuple[str, Any], ...] = (
                ("format", FORMAT), ("names", names), ("zero1", zero1), ("zero_size", dp if zero1 else 1),
                ("dp_rank", dp_rank), ("owned", owned), ("param_groups", param_groups))
            if ep > 1:
                plain += (("ep", ep), ("ep_rank", ep_rank))
            tensors = tuple(t for part, of in held for n in of
                            for t in state_of(part.shard.path, part.by_name[n]).values())
            out.append(OutFile(optimizer_file(tp_rank=tp, pp_rank=pp, dp_rank=dp_rank), "torch", tensors, plain))
    return out


class _Part:
    """The parameters of one shard whose state one group of dp ranks partitions (all of dp: the non-expert ones;
    an ep rank's expert-data-parallel ranks: its experts), as torch's ZeroRedundancyOptimizer would."""

    def __init__(self, shard: OutFile, experts: set[str], expert: bool, world: int) -> None:
        params = [t for t in shard.tensors if not t.key.endswith("inv_freq") and (t.key in experts) == expert]
        self.shard, self.names = shard, [t.key for t in params]
        self.by_name = {t.key: t for t in params}
        groups = stage_groups(self.names, {t.key: t.shape for t in params})
        self._ranks = zero1_partition(groups, world) if world > 1 else [[[n for n, _ in g] for g in groups]]

    def owned(self, rank: int) -> list[str]:
        """The names whose state rank ``rank`` of the group holds (every name when the group is one rank)."""
        return [n for g in self._ranks[rank] for n in g] if rank < len(self._ranks) else []

"""One ``--part K/N`` of a training tag's reshard, planned from its own files' sources only.

Planning an optimizer file reads the state it moves (dtypes and shapes: NxD's optimizer files are parsed for
them), so a part that planned every file would read every (dp, tp, pp) optimizer file of the tag: with one
part per rank (``nxdtrain run --optimizer-format nxd`` saves so) the reads grow with the square of the world.
Here the files are split between the parts before the optimizer is planned: each target shard's model file
and each of its optimizer files is one unit (the optimizer files weighed as their shard's file: their size is
not known before the state is read), assigned as :func:`ckptconv.engine.finalize.assign` assigns files. A part plans
the optimizer state of the shards whose units it holds and writes its units. Each replica group (K/V heads,
norms, and their optimizer state: copies that must agree) is checked by exactly one part, the one writing the
first file that reads it: every group is still checked, once in all rather than once per part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckptconv.core.plan import OutFile, Plan, ReplicaGroup
from ckptconv.engine.finalize import assign
from ckptconv.io.nxd import TENSORS_SUFFIX
from ckptconv.training.nxdtrain_format.state import optimizer_file


def optimizer_paths(shard: OutFile, *, dp: int, zero1: bool) -> list[str]:
    """The optimizer files written beside a target shard: one per dp rank with ZeRO-1, else dp rank 0's."""
    ranks = shard.shard_id
    return [optimizer_file(tp_rank=ranks.tp, pp_rank=ranks.pp, dp_rank=d) for d in range(dp if zero1 else 1)]


@dataclass(frozen=True)
class TagPart:
    """What one part of a training tag's reshard writes."""

    mine: frozenset[str]           # the files this part writes
    shards: tuple[OutFile, ...]    # the target shards whose optimizer state it plans (their files, or some: mine)
    optimizer_files: tuple[str, ...]  # every part's optimizer files
    count: int                     # how many files all parts write
    replicas: tuple[ReplicaGroup, ...]  # the weights' replica groups this part checks (and their optimizer state's)
    declared: tuple[str, ...] = ()   # every path any part may create (see :meth:`declaring`)

    @classmethod
    def split(cls, plan: Plan, part: tuple[int, int], *, dp: int, zero1: bool) -> TagPart:
        """``plan``: the model shards of the whole reshard."""
        owner: dict[str, OutFile] = {}
        units: list[tuple[str, int]] = []
        for shard in plan.files:
            for path in [shard.path, *optimizer_paths(shard, dp=dp, zero1=zero1)]:
                owner[path] = shard
                units.append((path, shard.nbytes))
        mine = assign(units, part)
        owned = {owner[p].path for p in mine}  # the shards whose model or optimizer files this part writes
        shards = tuple(s for s in plan.files if s.path in owned)
        model = {s.path for s in plan.files}
        # a part without files still plans one shard: the finalize spec it may write describes the optimizer
        return cls(frozenset(mine), shards or tuple(plan.files[:1]), tuple(p for p, _ in units if p not in model),
                   len(units), _checked_here(plan, mine, part, dp=dp, zero1=zero1))

    def declaring(self, paths: list[str]) -> TagPart:
        """With every path of the conversion: ``paths`` (the whole model plan's and this part's outputs) and
        every part's optimizer files (each as a torch zip with its xser ``.tensors`` directory)."""
        optim = [q for p in self.optimizer_files for q in (p, p + TENSORS_SUFFIX)]
        return replace(self, declared=tuple(sorted(set(paths) | set(optim))))

    def sources(self) -> set[tuple[int, int]]:
        """The (tp, pp) ranks of the tag that its shards and replica groups read."""
        pieces = [p for s in self.shards for t in s.tensors for p in t.pieces]
        pieces += [a for p in pieces for a in p.alternates]  # copies averaged into a piece (--kv-replicas mean)
        pieces += [c for g in self.replicas for c in g.copies]
        return {(p.source.shard.tp, p.source.shard.pp) for p in pieces if p.source.shard is not None}

    def planned(self) -> Plan:
        """What this part plans the optimizer state of: its shards, and the replica groups it checks."""
        return Plan(list(self.shards), list(self.replicas))

    def narrowed(self, plan: Plan) -> Plan:
        """Of the planned (extended) plan, the files this part writes; its replica groups stay. A planned file that
        is no unit (the optimizer's files not as :func:`optimizer_paths` names them) would be written by no part."""
        units = {s.path for s in self.shards} | set(self.optimizer_files)
        stray = sorted(f.path for f in plan.files if f.path not in units)
        if stray:
            raise RuntimeError(f"{stray[0]}: planned, but not among the files split between the parts")
        return Plan([f for f in plan.files if f.path in self.mine], plan.replicas)


def _checked_here(plan: Plan, mine: set[str], part: tuple[int, int], *, dp: int,
                  zero1: bool) -> tuple[ReplicaGroup, ...]:
    """The replica groups of ``plan`` this part checks: each group by one part, the one writing the first file
    (by path) of the shards that read it (model file or optimizer file); a group no shard reads, by part 0."""
    readers: dict[tuple[str, str], list[OutFile]] = {}
    for shard in plan.files:
        for source in {(str(p.source.file), p.source.key) for t in shard.tensors for p in t.pieces}:
            readers.setdefault(source, []).append(shard)
    here = []
    for group in plan.replicas:
        shards = [s for c in group.copies for s in readers.get((str(c.source.file), c.source.key), [])]
        paths = [p for s in shards for p in [s.path, *optimizer_paths(s, dp=dp, zero1=zero1)]]
        if (min(paths) in mine) if paths else part[0] == 0:
            here.append(group)
    return tuple(here)

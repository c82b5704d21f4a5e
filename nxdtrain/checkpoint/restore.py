"""One rank's weights and optimizer state from a tag of any layout, read through ckptconv's reshard plan.

A resume at another tp/pp/vpp/kvm/dp/ZeRO-1 needs no offline step: each rank plans the reshard of the
tag to the run's layout (index arithmetic only), keeps the plan of its own shard, and reads just those
slices of the tag's shards and optimizer files (:class:`ckptconv.training.nxdtrain_format.state.TagOptimizer`: the
moments and fp32 masters of a parameter move exactly like its rows). The optimizer files may be of
any dp size, with ZeRO-1 or without: state is looked up by parameter, wherever it was saved.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptconv.core import (
    OutTensor,
    ParallelLayout,
    all_ep_shard_records,
    layout_shard_file,
    plan_reshard,
    stores_lm_head,
)
from ckptconv.engine import read_tensor
from ckptconv.errors import ConversionError
from ckptconv.io import NxdCheckpoint
from ckptconv.sources import nxd_masters
from ckptconv.training import (
    Hyper,
    NxdOptimizer,
    NxdTagOptimizer,
    OptimizerSource,
    TagOptimizer,
    TagReader,
    state_tensors,
)
from nxdtrain.checkpoint.resume import damaged
from nxdtrain.errors import TrainError


class StageReader:
    """The tensors of shard (tp_rank, pp_rank) of ``run``, from the tag ``source`` (a ResumeSource)."""

    def __init__(self, source: Any, run: ParallelLayout, *, tp_rank: int, pp_rank: int, optimizer: bool,
                 ep_rank: int = 0) -> None:
        self.source = source
        try:
            self.shards = NxdCheckpoint(source.root, io="read")
            dtypes = self._planning_dtypes()
            plan = plan_reshard(source.spec, source.layout, run, dtypes)
            # An ep rank > 0 holds ep rank 0's tensors but its own experts (NxD keeps the rest in ep rank 0's files).
            wanted = [layout_shard_file(run, ep_rank=e, tp_rank=tp_rank, pp_rank=pp_rank) for e in sorted({0, ep_rank})]
            by_path = {f.path: f for f in plan.files}
            self.tensors: dict[str, OutTensor] = {t.key: t for path in wanted for t in by_path[path].tensors}
            files = {str(p.source.file) for t in self.tensors.values() for p in t.pieces}
            # (ep, tp, pp) of each shard read, as the plan carries it (ckptconv.core.layout.ShardId)
            read_from = {p.source.shard for t in self.tensors.values() for p in t.pieces}
            if source.nxd:  # NxD's masters-only tag: the weights are the fp32 masters in optim/ (its optimizer,
                # parsed there, is kept open for the optimizer state below: one parse of NxD's files per rank,
                # and of the files of the ranks this one reads only)
                nxd_masters(self.shards, None, prefer=False, io="read", check=True, keep=optimizer, only=files)
            self.optim: OptimizerSource | None = None
            if optimizer and source.nxd:
                self.optim = NxdTagOptimizer(self.shards.nxd_optimizer or NxdOptimizer(self.shards, io="read"))
            elif optimizer:
                self.optim = TagOptimizer(
                    source.root, source.spec, source.layout,
                    lm_head_copy=stores_lm_head(source.spec, dtypes), checks=self.shards.checks, io="read",
                    only={r for r in read_from if r is not None})
        except ConversionError as exc:
            self.close()
            raise self.error(exc) from None
        self.reader = TagReader(self.shards, self.optim) if self.optim is not None else self.shards

    def _planning_dtypes(self) -> dict[str, torch.dtype]:
        """Every source key, for the plan's arithmetic: the pieces depend on keys, not dtypes (the model casts what
        is read to its own). Only a tied model's last-stage header is read (whether its shards hold lm_head), so a
        rank opens, and checks, just the files it reads from, not every shard of the tag."""
        spec, layout = self.source.spec, self.source.layout
        last = layout_shard_file(layout, ep_rank=0, tp_rank=0, pp_rank=layout.pp - 1)
        copy = not spec.tied or stores_lm_head(spec, self.shards.keys(last))
        records = all_ep_shard_records(spec, layout, lm_head_copy=copy)
        return {r.key: torch.float32 for shard in records.values() for r in shard}

    def error(self, exc: ConversionError) -> TrainError:
        """A damaged or unreadable tag, in nxdtrain's words (it has no --no-check)."""
        return TrainError(f"{self.source.flag} {self.source.given}: {damaged(exc)}")

    def weights(self) -> dict[str, torch.Tensor]:
        """The shard's tensors (weights and buffers), as the run's model names them."""
        try:
            return {key: read_tensor(t, self.reader) for key, t in self.tensors.items()}
        except ConversionError as exc:
            raise self.error(exc) from None

    def optimizer_state(self, name: str, only: str | None = None) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s optimizer tensors by component, in this rank's layout."""
        assert self.optim is not None
        try:
            planned = state_tensors(self.tensors[name], self.optim)
            return {c: read_tensor(t, self.reader) for c, t in planned.items() if only is None or c == only}
        except ConversionError as exc:
            raise self.error(exc) from None

    @property
    def hyper(self) -> Hyper:
        assert self.optim is not None
        return self.optim.hyper

    def finish(self) -> None:
        """Every byte read matched the tag's recorded digests (else an error naming the file)."""
        try:
            self.shards.finish_checks(workers=1)
            if self.optim is not None:
                self.optim.finish_checks(workers=1)
        except ConversionError as exc:
            raise self.error(exc) from None
        finally:
            self.close()

    def close(self) -> None:
        for part in (getattr(self, "optim", None), getattr(self, "shards", None)):
            if part is not None:
                part.close()

"""NxD's own optimizer files seen as :class:`ckptconv.training.nxdtrain_format.state.TagOptimizer` sees nxdtrain's.

A resume reads a parameter's optimizer tensors through the reshard plan by ``Source(model shard file,
"<component>:<key>")`` (:func:`ckptconv.training.nxdtrain_format.state.component_source`), whatever wrote them. This
adapter answers those reads from :class:`ckptconv.training.nxd_format.read.NxdOptimizer` (plain AdamW, ZeRO-1 with or
without masters, xser, the DCP variant): AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` and, where NxD saved
them, the fp32 (fp64) ``master`` weights, each row slice read only from the dp chunks that hold it.

NxD groups parameters by name (no weight decay for names with ``bias``/``norm``, or one group); nxdtrain
by shape (matrices decayed, vectors not). :attr:`NxdTagOptimizer.hyper` gives NxD's hyper-parameters
in nxdtrain's two groups, and refuses where a group of ours would hold parameters NxD stepped with
different hyper-parameters (they could not be continued exactly).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError
from ckptconv.training.nxd_format.files import MOMENTS
from ckptconv.training.nxd_format.ranks import OptimFormat
from ckptconv.training.nxd_format.read import NxdOptimizer
from ckptconv.training.nxdtrain_format.placement import is_matrix
from ckptconv.training.nxdtrain_format.state import MASTER, Hyper, split_key

STEP = "step"


class NxdTagOptimizer:
    """The reader interface of :class:`~ckptconv.training.nxdtrain_format.state.TagOptimizer` over an :class:`NxdOptimizer`
    (closed with this object)."""

    def __init__(self, optim: NxdOptimizer) -> None:
        self.optim = optim
        self.components: tuple[str, ...] = (STEP, *MOMENTS, *((MASTER,) if optim.has_masters else ()))
        # NxD's hyper-parameters in our groups, from the ranks parsed so far (the first one at least); a rank parsed
        # later, when a read first reaches it, must fit them (_fits): no rank is parsed only to be compared
        self._ours: list[dict[str, Any] | None] = [None, None]
        self._fitted: set[tuple[int, int, int]] = set()
        self._lock = threading.Lock()
        for tp, pp in optim.parsed_ranks():
            for ep in range(optim.ep):
                self._fits(ep, tp, pp)
        groups = [g if g is not None else dict(self._ours[0] or {}) for g in self._ours]
        self._ours = list(groups)  # settled: later ranks are compared with these
        self.hyper = Hyper(groups, optim.format is not OptimFormat.ADAMW, optim.dp, self.components, ())

    @property
    def precision(self) -> str:
        """nxdtrain's precision of NxD's run: bf16 where its model files hold bf16 weights (the fp32 or fp64 masters
        are the optimizer's), else fp32; as the files declare them, since a masters-only tag saved none and its
        weights are read from the masters. The one answer for a resume of the tag and for its reshard. One file per
        stage speaks for its stage (``NxdCheckpoint.stage_files``; the others are checked by ``check_stages``)."""
        model = self.optim.model
        dtypes = {dtype for file in model.stage_files() for dtype, _ in model.declared(file).values()}
        return "bf16" if torch.bfloat16 in dtypes else "fp32"

    def _fits(self, ep: int, tp: int, pp: int) -> None:
        """NxD's hyper-parameters of rank (tp, pp) per nxdtrain group (0: matrices, 1: vectors) are those of every
        rank fitted before it (after __init__: those of :attr:`hyper`); checked once per rank, at its first read."""
        with self._lock:
            if (tp, pp, ep) in self._fitted:
                return
            ours = self._ours
            groups = self.optim.groups(tp, pp, ep)
            shapes = {name: self.optim.slot_info(tp, pp, name, ep)[1] for group in groups for name in group["params"]}
            for g, group in enumerate(groups):
                hyper = {k: v for k, v in group.items() if k != "params"}
                for name in group["params"]:
                    mine = 0 if is_matrix(shapes[name]) else 1
                    known = ours[mine]
                    if known is None:  # only before the groups settle (__init__)
                        ours[mine] = hyper
                    elif known != hyper:
                        kind = "matrices" if mine == 0 else "vectors (norm weights, biases)"
                        raise ConversionError(
                            f"{self.optim.dir}: NxD's param group {g} of tp rank {tp} pp rank {pp} holds {name!r} "
                            f"with hyper-parameters {hyper}, other {kind} have {known}; nxdtrain steps all "
                            f"{kind} with one set, so this state cannot be continued exactly")
            self._fitted.add((tp, pp, ep))

    def _where(self, source: Source) -> tuple[int, int, int, str, str]:
        """(tp, pp, ep rank, component, name) of a read."""
        component, name = split_key(source.key)
        ranks = source.shard  # (ep, tp, pp), from the plan
        if component is None or ranks is None:
            raise ConversionError(f"{self.optim.dir}: no optimizer tensor for {source.file}: {source.key}")
        self._fits(*ranks)  # its files parsed now if not yet, and its param groups compared with ours
        return ranks[1], ranks[2], ranks[0], component, name

    def components_of(self, source: Source) -> list[str]:
        """The optimizer tensors the parameter stored at ``source`` has in NxD's files."""
        return list(self.components)

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        tp, pp, ep, component, name = self._where(source)
        if component == STEP:
            return torch.float32, (), False
        # the moments: the parameter's dtype without ZeRO-1, the optimizer's (fp32, fp64) with it
        return self.optim.dtype_of(tp, pp, name, component, ep), self.optim.slot_info(tp, pp, name, ep)[1], False

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        tp, pp, ep, component, name = self._where(source)
        if component == STEP:
            rows = torch.tensor([self.optim.param_step(tp, pp, name, ep)], dtype=torch.float32)[start:stop]
        else:
            rows = self.optim.rows(tp, pp, name, component, start, stop, ep)
        return rows if out is None else out.view(rows.shape).copy_(rows)

    def finish_checks(self, *, workers: int = 8) -> int:
        """Complete the checks of the optimizer files read (zip CRC-32s, small files whole)."""
        return self.optim.finish_checks(workers=workers)

    def close(self) -> None:
        self.optim.close()

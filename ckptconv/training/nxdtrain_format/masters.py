"""A checkpoint's nxdtrain optimizer state opened beside its shards: the fp32 masters a bf16 run keeps, read as its
weights (to-hf of such a tag, ``--masters``: :func:`use_masters`), and what ``inspect`` says of that state
(:func:`nxdtrain_optimizer_summary`). The state itself, by parameter: :mod:`ckptconv.training.nxdtrain_format.state`.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io.tags import OPTIM_DIR
from ckptconv.training.nxdtrain_format.state import MASTER, TagOptimizer, component_source, lm_head_copy_of


class _ShardMasters:
    """One shard's fp32 masters, by the shard's parameter names (a file reader for NxdCheckpoint)."""

    def __init__(self, optim: TagOptimizer, shard: str) -> None:
        self.optim, self.shard = optim, shard

    def keys(self) -> list[str]:
        return self.optim.names_with(self.shard, MASTER)

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        return self.optim.info(component_source(Source(self.shard, key), MASTER))

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.optim.read_rows(component_source(Source(self.shard, key), MASTER), start, stop, out)

    def close(self) -> None:  # the TagOptimizer's owner closes it
        pass


def _tag_optimizer(ckpt: Any, spec: ModelSpec, layout: ParallelLayout) -> tuple[TagOptimizer | None, str]:
    """The TagOptimizer of ``ckpt``'s ``optim/``, or None and why where its files are not nxdtrain's (NxD's
    format, say); a damaged file of ours still raises IntegrityError."""
    try:
        return TagOptimizer(ckpt.root, spec, layout, lm_head_copy=lm_head_copy_of(ckpt, spec, layout),
                            checks=ckpt.checks, io=ckpt.io), ""
    except IntegrityError:
        raise
    except ConversionError as exc:
        return None, str(exc)


def nxdtrain_optimizer_summary(ckpt: Any, spec: ModelSpec, layout: ParallelLayout) -> dict[str, Any] | None:
    """What ``inspect`` says of an nxdtrain tag's ``optim/`` (format 1 or 2), or None where it holds another
    format (NxD's own: :func:`ckptconv.training.nxd_format.read.nxd_optimizer_summary`) or there is none."""
    if not (ckpt.root / OPTIM_DIR).is_dir():
        return None
    optim, _ = _tag_optimizer(ckpt, spec, layout)
    if optim is None:
        return None
    try:
        hyper = optim.hyper
        return {"format": f"nxdtrain {'/'.join(str(f) for f in hyper.formats)}", "zero1": hyper.zero1,
                "dp": hyper.zero_size if hyper.zero1 else None, "files": len(optim.files),
                "components": list(hyper.components), "masters": MASTER in hyper.components,
                "param_groups": len(hyper.param_groups)}
    finally:
        optim.close()


def use_masters(ckpt: Any, spec: ModelSpec, layout: ParallelLayout, *, required: bool) -> TagOptimizer | None:
    """Make ``ckpt`` (an NxdCheckpoint) read its weights from the fp32 masters a bf16 nxdtrain run keeps with its
    optimizer state (format 2 or 1, any dp or ZeRO-1; closed with ``ckpt``); return the TagOptimizer, or None
    (an error when ``required``) where the tag has no masters: no ``optim/``, an fp32 run, other files."""
    directory = ckpt.root / OPTIM_DIR

    def none(why: str) -> TagOptimizer | None:
        if required:
            raise ConversionError(f"{why}, so no nxdtrain master weights to export (--masters)")
        return None

    if not directory.is_dir():
        return none(f"{directory}: missing")
    optim, why = _tag_optimizer(ckpt, spec, layout)
    if optim is None:
        return none(why)
    if MASTER not in optim.hyper.components:
        optim.close()
        return none(f"{directory}: optimizer state without fp32 masters (an fp32 run: its weights are the masters)")
    identity = [(str(f.path), f.path.stat().st_size, f.path.stat().st_mtime_ns) for f in optim.files]
    ckpt.use_masters(lambda shard: _ShardMasters(optim, shard), identity, optim)
    return optim

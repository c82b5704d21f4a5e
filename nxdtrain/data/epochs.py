"""How long a run is: steps per epoch, total steps and warmup steps, for ``nxdtrain steps`` and ``run``.

An epoch is ``rows // gbs`` global batches: the last ``rows % gbs`` rows of each epoch's order are
not trained on (the last partial global batch is dropped, as NeMo/NxDT's Megatron samplers do with
``drop_last``), so every step sees exactly ``gbs`` rows. ``--warmup`` is read as transformers reads
``warmup_steps``: a value >= 1 is a step count (``1.0`` is one step; it must be a whole number), a
value in (0, 1) is a fraction of the run's total steps, rounded up.

    >>> plan = run_length(rows=1000, gbs=64, epochs=2, warmup=0.01)
    >>> plan.steps_per_epoch, plan.steps, plan.warmup, plan.dropped_per_epoch
    (15, 30, 1, 40)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nxdtrain.config.options import TrainConfig
from nxdtrain.errors import TrainError


@dataclass(frozen=True)
class RunLength:
    """The step arithmetic of one run (``rows`` and the per-epoch numbers are None for endless data)."""

    rows: int | None
    gbs: int
    epochs: int | None
    steps_per_epoch: int | None
    dropped_per_epoch: int | None  # rows of each epoch's order that no step uses
    steps: int
    warmup: int


def warmup_steps(warmup: float, steps: int) -> int:
    """``--warmup`` as a step count: a whole number >= 1 as is, a fraction of ``steps`` rounded up."""
    if warmup >= 1:
        return int(warmup)
    return math.ceil(steps * warmup)


def epoch_samples(rows: int, gbs: int) -> int:
    """Samples in one epoch: whole global batches only (the last partial one is dropped)."""
    return (rows // gbs) * gbs


def run_length(*, rows: int | None, gbs: int, epochs: int | None = None, steps: int | None = None,
               warmup: float = 0) -> RunLength:
    """Steps per epoch, total steps and warmup steps; ``epochs`` sizes the run from ``rows``, else ``steps``."""
    per_epoch = dropped = None
    if rows is not None:
        per_epoch, dropped = rows // gbs, rows % gbs
    if epochs is not None:
        if rows is None:
            raise TrainError("--epochs needs a finite --data (synthetic data has no epochs); use --steps")
        if not per_epoch:
            raise TrainError(f"--epochs: --data has {rows} rows, fewer than one global batch (--gbs {gbs})")
        total = epochs * per_epoch
    elif steps is not None:
        total = steps
    else:
        raise TrainError("give --epochs or --steps")
    return RunLength(rows, gbs, epochs, per_epoch, dropped, total, warmup_steps(warmup, total))


def data_parallel(*, world: int, tp: int, pp: int, gbs: int, mbs: int, cp: int = 1) -> tuple[int, int]:
    """(dp, microbatches per dp rank) of a world; the batch arithmetic ``run`` and ``steps`` share.

    The cp ranks of a data-parallel replica read the same rows (each keeps its chunks of them)."""
    if world % (tp * pp * cp):
        what = f"--tp {tp} x --pp {pp}" + (f" x --context-parallel {cp}" if cp > 1 else "")
        raise TrainError(f"world size {world} (--nproc or the launcher's) is not a multiple of {what}")
    dp = world // (tp * pp * cp)
    if gbs % (mbs * dp):
        raise TrainError(f"--gbs {gbs} must be a multiple of --mbs {mbs} x data-parallel size {dp}")
    return dp, gbs // (mbs * dp)


def resolve(config: TrainConfig, rows: int | None) -> TrainConfig:
    """``config`` with ``--epochs`` turned into ``steps`` and ``--warmup`` into a step count.

    Idempotent: every process of a world resolves the same config to the same numbers.
    """
    if config.epochs is None and float(config.optim.warmup).is_integer():
        return config
    length = run_length(rows=rows, gbs=config.data.gbs, epochs=config.epochs,
                        steps=None if config.epochs is not None else config.steps, warmup=config.optim.warmup)
    optim = dataclasses.replace(config.optim, warmup=length.warmup)
    return dataclasses.replace(config, steps=length.steps, epochs=None, optim=optim)

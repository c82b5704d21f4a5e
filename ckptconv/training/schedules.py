"""The learning-rate schedules of nxdtrain runs, as a training tag's ``scheduler.pt`` records them.

One place for the formula: nxdtrain's training loop and ckptconv's TorchTitan export (which writes the
lr of the next step into TorchTitan's param groups) both read it here. ``cfg`` is anything with the
fields ``schedule``, ``lr``, ``min_lr`` and ``warmup`` (nxdtrain's ``OptimConfig``, or :class:`Recorded`).

    >>> cfg = Recorded(schedule="linear", lr=1.0, min_lr=0.0, warmup=2)
    >>> [lr_at(s, cfg, decay_steps=6) for s in range(1, 7)]
    [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ckptconv.errors import ConversionError

# NxDT's schedules by their class names (NeMo's CosineAnnealing, NxDT's LinearAnnealingWithWarmUp)
NXDT_SCHEDULES = ("CosineAnnealing", "LinearAnnealingWithWarmUp")


class ScheduleConfig(Protocol):
    @property
    def schedule(self) -> str: ...
    @property
    def lr(self) -> float: ...
    @property
    def min_lr(self) -> float | None: ...
    @property
    def warmup(self) -> float: ...


@dataclass(frozen=True)
class Recorded:
    """A schedule as ``scheduler.pt`` records it."""

    schedule: str
    lr: float
    min_lr: float | None
    warmup: float


def lr_at(step: int, cfg: ScheduleConfig, *, decay_steps: int) -> float:
    """Learning rate of the update that produces global step ``step`` (1-based).

    Warmup: ``lr·step/warmup`` for ``step <= warmup``. Then ``constant`` keeps ``lr``; ``linear``
    and ``cosine`` go from ``lr`` to ``min_lr`` at ``step == decay_steps`` and stay there.
    ``warmup`` is a step count here (nxdtrain resolves a fraction of the run before training; one is refused).
    """
    if 0 < cfg.warmup < 1:
        raise ConversionError(f"--warmup {cfg.warmup} is a fraction of the run: resolve it first "
                              "(nxdtrain.data.epochs.resolve)")
    if cfg.schedule in NXDT_SCHEDULES:  # NxDT's own step counting
        return nxdt_lr(step, cfg, decay_steps=decay_steps)
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup) / max(1, decay_steps - cfg.warmup))
    min_lr = cfg.min_lr
    assert min_lr is not None, "OptimConfig.__post_init__ resolves min_lr"
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - min_lr) * progress
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def nxdt_lr(step: int, cfg: ScheduleConfig, *, decay_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based) under the NxDT schedule ``cfg.schedule``, as an NxDT YAML's
    ``model.optim.sched.name`` selects it.

    NxDT steps a torch ``LRScheduler`` after every optimizer step, so optimizer step ``n`` (1-based, our ``step``) runs
    at the scheduler's index ``s = n - 1``. With ``W`` = warmup_steps, ``M`` = max_steps (our ``decay_steps``), ``lr``
    the peak and ``min_lr`` the floor:

    * ``CosineAnnealing`` (NeMo's, ``constant_steps: 0``): ``lr·(s+1)/(W+1)`` while ``s <= W`` (when ``W > 0``),
      then ``min_lr + (lr - min_lr)·(1 + cos(π·(s-W)/(M-W)))/2``, and ``min_lr`` once ``s > M``.
    * ``LinearAnnealingWithWarmUp`` (NxDT's, transformers' linear schedule): ``lr·s/W`` while ``s < W`` (so the
      first step runs at 0), then ``lr·max(0, (M-s)/(M-W))``: down to 0, no minimum.

        >>> cfg = Recorded(schedule="LinearAnnealingWithWarmUp", lr=1.0, min_lr=None, warmup=3)
        >>> [round(nxdt_lr(n, cfg, decay_steps=7), 4) for n in range(1, 9)]
        [0.0, 0.3333, 0.6667, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    s, warmup, total = step - 1, int(cfg.warmup), decay_steps
    min_lr = cfg.min_lr or 0.0
    # the rate times the schedule's factor, in the order torch's LambdaLR/transformers and NeMo compute them
    # (so a scheduler state written from here holds NxDT's own numbers to the last bit)
    if cfg.schedule == "LinearAnnealingWithWarmUp":
        if s < warmup:
            return cfg.lr * (float(s) / float(max(1, warmup)))
        return cfg.lr * max(0.0, (total - s) / max(1, total - warmup))
    if cfg.schedule == "CosineAnnealing":
        if warmup > 0 and s <= warmup:
            return cfg.lr * ((s + 1) / (warmup + 1))
        if s > total or total <= warmup:
            return min_lr
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (s - warmup) / (total - warmup)))
    raise ValueError(f"not an NxDT schedule: {cfg.schedule!r}")

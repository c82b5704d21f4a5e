"""NxDT's learning-rate schedules, as an NxDT YAML's ``model.optim.sched.name`` selects them.

NxDT steps a torch ``LRScheduler`` after every optimizer step, so optimizer step ``n`` (1-based, our
``step``) runs at the scheduler's index ``s = n - 1``. With ``W`` = warmup_steps, ``M`` = max_steps (our
``decay_steps``), ``lr`` the peak and ``min_lr`` the floor:

* ``CosineAnnealing`` (NeMo's, ``constant_steps: 0``): ``lr·(s+1)/(W+1)`` while ``s <= W`` (when ``W > 0``),
  then ``min_lr + (lr - min_lr)·(1 + cos(π·(s-W)/(M-W)))/2``, and ``min_lr`` once ``s > M``.
* ``LinearAnnealingWithWarmUp`` (NxDT's, transformers' linear schedule): ``lr·s/W`` while ``s < W`` (so the
  first step runs at 0), then ``lr·max(0, (M-s)/(M-W))``: down to 0, no minimum.

Ours (``cosine``, ``linear``, ``constant``) are :func:`nxdtrain.optim.lr_at`'s.

    >>> from nxdtrain.config import OptimConfig
    >>> cfg = OptimConfig(lr=1.0, warmup=3, schedule="LinearAnnealingWithWarmUp")
    >>> [round(nxdt_lr(n, cfg, decay_steps=7), 4) for n in range(1, 9)]
    [0.0, 0.3333, 0.6667, 1.0, 0.75, 0.5, 0.25, 0.0]
"""

from __future__ import annotations

import math

from nxdtrain.config import OptimConfig


def nxdt_lr(step: int, cfg: OptimConfig, *, decay_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based) under the NxDT schedule ``cfg.schedule``."""
    s, warmup, total = step - 1, int(cfg.warmup), decay_steps
    min_lr = cfg.min_lr or 0.0
    if cfg.schedule == "LinearAnnealingWithWarmUp":
        if s < warmup:
            return cfg.lr * s / max(1, warmup)
        return cfg.lr * max(0.0, (total - s) / max(1, total - warmup))
    if cfg.schedule == "CosineAnnealing":
        if warmup > 0 and s <= warmup:
            return cfg.lr * (s + 1) / (warmup + 1)
        if s > total or total <= warmup:
            return min_lr
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (s - warmup) / (total - warmup)))
    raise ValueError(f"not an NxDT schedule: {cfg.schedule!r}")

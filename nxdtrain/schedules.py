"""NxDT's learning-rate schedules, as an NxDT YAML's ``model.optim.sched.name`` selects them.

NxDT steps a torch ``LRScheduler`` after every optimizer step, so optimizer step ``n`` (1-based, our
``step``) runs at the scheduler's index ``s = n - 1``. With ``W`` = warmup_steps, ``M`` = max_steps (our
``decay_steps``), ``lr`` the peak and ``min_lr`` the floor:

* ``CosineAnnealing`` (NeMo's, ``constant_steps: 0``): ``lr·(s+1)/(W+1)`` while ``s <= W`` (when ``W > 0``),
  then ``min_lr + (lr - min_lr)·(1 + cos(π·(s-W)/(M-W)))/2``, and ``min_lr`` once ``s > M``.
* ``LinearAnnealingWithWarmUp`` (NxDT's, transformers' linear schedule): ``lr·s/W`` while ``s < W`` (so the
  first step runs at 0), then ``lr·max(0, (M-s)/(M-W))``: down to 0, no minimum.

Ours (``cosine``, ``linear``, ``constant``) are :func:`nxdtrain.optim.lr_at`'s.

    >>> from nxdtrain.config.options import OptimConfig
    >>> cfg = OptimConfig(lr=1.0, warmup=3, schedule="LinearAnnealingWithWarmUp")
    >>> [round(nxdt_lr(n, cfg, decay_steps=7), 4) for n in range(1, 9)]
    [0.0, 0.3333, 0.6667, 1.0, 0.75, 0.5, 0.25, 0.0]
"""

from __future__ import annotations

from ckptconv.training import nxdt_lr

__all__ = ["nxdt_lr"]  # the formula lives in ckptconv (one place: training and the TorchTitan export)

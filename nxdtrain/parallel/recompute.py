"""Activation checkpointing: keep fewer activations in the forward, recompute them in the backward.

``selective`` recomputes the attention core only (``softmax(QKᵀ)V`` and the GQA K/V expansion),
whose saved tensors grow with heads x seq; ``full`` keeps only each decoder layer's input and
recomputes the whole layer. Both use ``torch.utils.checkpoint`` without reentrancy, which saves
and restores the RNG state around the recomputation (the results are bitwise those of ``none``)
and works under the pipeline schedules' ``torch.autograd.backward`` calls. A recomputed layer
repeats its tensor-parallel collectives in the backward, in the same order on every tp rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nxdtrain.config import RECOMPUTE as MODES  # noqa: F401  (re-exported: the modes, defined with the flag)

# NxDT's activations_checkpoint_recompute names the modules `selective` recomputes; ours is the attention core.
NXDT_SELECTIVE_MODULES = ("CoreAttention",)


def maybe_checkpoint(enabled: bool, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, its activations recomputed in the backward when ``enabled`` and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)

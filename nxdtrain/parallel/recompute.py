"""Activation checkpointing: keep fewer activations in the forward, recompute them in the backward.

``selective`` recomputes the modules named by NxDT's names (``--recompute-modules``, NxDT's
``model.activations_checkpoint_recompute``), each wrapped where NxDT wraps its module of that name:
``CoreAttention`` the attention core (``softmax(QKᵀ)V`` and the GQA K/V expansion; the default), ``LlamaMLP``
the whole MLP, ``ActivationMultiplyMLP`` ``act(gate)·up`` between its projections, ``LlamaRMSNorm`` every
RMSNorm, ``LlamaDecoderLayer`` whole layers (as ``full``). ``full`` keeps only each decoder layer's input and
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

from nxdtrain.config.options import RECOMPUTE as MODES  # noqa: F401  (re-exported: the modes, defined with the flag)
from nxdtrain.config.options import RECOMPUTE_MODULES as NXDT_SELECTIVE_MODULES  # noqa: F401  (NxDT's module names)


def maybe_checkpoint(enabled: bool, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, its activations recomputed in the backward when ``enabled`` and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)

"""``--offload-activations``: the activations saved for the backward are kept in host memory during the forward
(``torch.autograd.graph.save_on_cpu``, pinned) and copied back to the accelerator when the backward needs them.

On a CPU the activations are in host memory already: the option is accepted and has no effect (the run says so
once); on xla it is refused before the run starts (:func:`nxdtrain.config.checks.xla_refusal`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

NO_EFFECT = "--offload-activations: no effect on cpu (the activations are in host memory already)"


def offloading(enabled: bool, device: torch.device) -> Any:
    """The context one step's forward and backward run in."""
    if enabled and device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()

"""The model a rank trains: one pipeline stage of a decoder on NxD's names and shapes, its dense MLP and which
gradients it sums with whom (stage.py); the sparse MLP and the router's aux loss (moe.py); RoPE (rope.py); one
step's microbatches through the stages and the loss (pipeline.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports

if TYPE_CHECKING:  # imported on first use (ckptconv.lazy_exports)
    from nxdtrain.model.stage import LlamaStage

__getattr__ = lazy_exports(__name__, __file__)

"""The model a rank trains: one pipeline stage of a decoder on NxD's parameter names and shapes (stage.py), its
dense and sparse MLPs (moe.py: the mixture-of-experts block and the router's aux loss), RoPE (rope.py), which
gradients it sums with whom (gradient_groups.py), and one step's microbatches through the stages (pipeline.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports

if TYPE_CHECKING:  # imported on first use (ckptconv.lazy_exports)
    from nxdtrain.model.stage import LlamaStage

__getattr__ = lazy_exports(__name__, __file__)

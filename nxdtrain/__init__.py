"""nxdtrain: continual pretraining straight from NxD tensor x pipeline (x expert) parallel shards.

``nxdtrain run --resume PATH`` loads the shards of a converted (or previously trained) checkpoint of a dense
decoder (Llama, Mistral, Qwen2, Qwen3) or a mixture of experts (Mixtral, Qwen3-MoE) into a tp x pp x dp (x cp, ep)
model on torch.distributed, trains it, writes NxD-layout checkpoints, and ``nxdtrain export`` turns one into a
Hugging Face directory. The layout, mapping and I/O are ckptconv's. Rooms: config/, parallel/, data/, model/,
checkpoint/; the trainer at the top. Public API (imported lazily, so ``import nxdtrain.config`` stays light):

    >>> from nxdtrain import TrainConfig, train, export     # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports
from nxdtrain.errors import TrainError

if TYPE_CHECKING:  # imported on first use (ckptconv.lazy_exports)
    from nxdtrain.checkpoint.export import export
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.model.stage import LlamaStage
    from nxdtrain.train import prepare, train

__all__ = ["TrainError", "TrainConfig", "train", "prepare", "export", "LlamaStage"]

__getattr__ = lazy_exports(__name__, __file__)

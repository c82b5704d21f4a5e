"""nxdtrain: continual pretraining of Llama straight from NxD tensor x pipeline parallel shards.

``nxdtrain run --resume PATH`` loads the shards of a converted (or previously trained) checkpoint
into a tp x pp x dp Llama on torch.distributed, trains it, writes NxD-layout checkpoints, and
``nxdtrain export`` turns one into a Hugging Face directory. The layout, mapping and I/O are
ckptconv's. Public API (imported lazily, so ``import nxdtrain.config.options`` stays light):

    >>> from nxdtrain import TrainConfig, train, export     # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports
from nxdtrain.errors import TrainError

if TYPE_CHECKING:  # imported on first use (ckptconv.lazy_exports)
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.model.stage import LlamaStage
    from nxdtrain.train import export, prepare, train

__all__ = ["TrainError", "TrainConfig", "train", "prepare", "export", "LlamaStage"]

__getattr__ = lazy_exports(__name__, __file__)

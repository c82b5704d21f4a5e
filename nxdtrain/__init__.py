"""nxdtrain: continual pretraining of Llama straight from NxD tensor x pipeline parallel shards.

``nxdtrain run --resume PATH`` loads the shards of a converted (or previously trained) checkpoint
into a tp x pp x dp Llama on torch.distributed, trains it, writes NxD-layout checkpoints, and
``nxdtrain export`` turns one into a Hugging Face directory. The layout, mapping and I/O are
ckptconv's. Public API (imported lazily, so ``import nxdtrain.config`` stays light):

    >>> from nxdtrain import TrainConfig, train, export     # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from nxdtrain.errors import TrainError

_API = {"TrainConfig": "nxdtrain.config", "train": "nxdtrain.train", "prepare": "nxdtrain.train",
        "export": "nxdtrain.train", "LlamaStage": "nxdtrain.model"}

__all__ = ["TrainError", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'nxdtrain' has no attribute {name!r}")

"""A run's configuration: the typed option tree every flag and YAML key fills (options.py), the ``--config`` file,
ours or NxDT-shaped (yaml_config.py) and its OmegaConf loader (yaml_load.py), and the checks a run passes before
any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv import lazy_exports

if TYPE_CHECKING:  # imported on first use (ckptconv.lazy_exports)
    from nxdtrain.config.options import CheckpointConfig, DataConfig, OptimConfig, ParallelConfig, TrainConfig

__getattr__ = lazy_exports(__name__, __file__)

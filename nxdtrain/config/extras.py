"""Optional packages (pyproject.toml's extras): a feature whose package is missing fails in one line naming the
feature, the package and the extra that installs it, before any process starts."""

from __future__ import annotations

import importlib
from types import ModuleType

from nxdtrain.errors import TrainError

# module -> (pip package, ckptconv extra)
EXTRAS = {"omegaconf": ("omegaconf", "train"), "datasets": ("datasets", "train"),
          "tensorboard": ("tensorboard", "viz"), "matplotlib": ("matplotlib", "viz"),
          "transformers": ("transformers", "hf")}


def require(module: str, feature: str) -> ModuleType:
    """``module`` imported, or a TrainError: ``FEATURE needs the PACKAGE package: pip install 'ckptconv[EXTRA]'``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package, extra = EXTRAS[module]
        raise TrainError(f"{feature} needs the {package} package: pip install 'ckptconv[{extra}]'") from None

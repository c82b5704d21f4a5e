"""ckptconv: HF (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE) <-> NxD tp x pp x ep shards <-> TorchTitan DCP (those and
DeepSeek-V3, GPT-OSS), streamed, verified.

The public API is a handful of verbs; everything the CLI does is one of these calls:
``to_nxd``, ``to_hf``, ``reshard``, ``inspect``, ``to_dcp``, ``from_dcp``, ``diff`` (imported lazily, so that importing a submodule
such as ``ckptconv.core.mapping`` stays cheap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.errors import ConversionError, VerificationError
from ckptconv.hall import __version__, lazy_exports, type_checking_imports  # noqa: F401  (the package's names)

if TYPE_CHECKING:  # the verbs, imported on first use (lazy_exports below)
    from ckptconv.commands.api import reshard, to_hf, to_nxd
    from ckptconv.commands.dcp import from_dcp, to_dcp
    from ckptconv.commands.diff import diff
    from ckptconv.commands.inspect import inspect
    from ckptconv.engine.options import RunOptions


__all__ = ["ConversionError", "VerificationError", "__version__", "RunOptions", "to_nxd", "to_hf", "reshard",
           "inspect", "to_dcp", "from_dcp", "diff"]


__getattr__ = lazy_exports(__name__, __file__)

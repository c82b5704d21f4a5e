"""Where a conversion reads from: NxD shards opened and checked (layout recorded or inferred), the fp32
masters of a training tag as its weights, and Hugging Face Hub ids resolved to local folders.

The names below are what the trainer (nxdtrain) uses of this room: its entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.hall import lazy_exports

if TYPE_CHECKING:
    from ckptconv.sources.masters import nxd_masters
    from ckptconv.sources.nxd import open_nxd

__getattr__ = lazy_exports(__name__, __file__)

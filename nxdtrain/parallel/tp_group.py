"""The tensor-parallel group a layer computes in: the one type the tp layers and sequence parallelism share.

Its own module so that :mod:`nxdtrain.parallel.layers` (the layers) and :mod:`nxdtrain.parallel.sequence`
(the collectives they call) both depend on it and not on each other.

Example:
    >>> TpGroup(size=2, rank=1).group is None    # offline: no process group
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TpGroup:
    """This rank's tensor-parallel group: size, rank, and the process group (None when size is 1 or offline)."""

    size: int = 1
    rank: int = 0
    group: Any = None
    sequence_parallel: bool = False  # activations outside tp regions are [batch, seq/tp, hidden] slices

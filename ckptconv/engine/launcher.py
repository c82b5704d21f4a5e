"""Which launcher started this process, and where the process sits in its job: one answer for both packages.

``ckptconv``'s ``--part`` default and ``nxdtrain``'s world both come from :func:`detect_launch`.

torchrun's variables win over Slurm's. torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` in every worker it starts; srun sets ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID`` (and ``SLURM_NTASKS_PER_NODE``) in every task. The usual multi-node launch,
``srun --ntasks-per-node 1 torchrun --nproc-per-node 8 ...``, leaves both sets in each worker: Slurm's
describe the torchrun agent (one task per node), torchrun's the worker itself, so torchrun's are the
more specific ones. Read the other way round, the 8 workers of a node would all claim the node's part.

Example:
    >>> detect_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "9", "WORLD_SIZE": "16"})
    Launch(rank=9, world_size=16, local_rank=0, launcher='torchrun')
    >>> detect_launch({})
    Launch(rank=0, world_size=1, local_rank=0, launcher='single')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ckptconv.errors import ConversionError

# (launcher, rank, world size, local rank), most specific first.
_LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
              ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


@dataclass(frozen=True)
class Launch:
    """This process's place in its job as the launcher describes it."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun", "slurm" or "single"


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """The first launcher whose rank and world-size variables are both set (torchrun, then Slurm), else one process."""
    env = os.environ if environ is None else environ
    for launcher, rank, world, local in _LAUNCHERS:
        if rank in env and world in env:
            return Launch(int(env[rank]), int(env[world]), int(env.get(local, "0")), launcher)
    return Launch(0, 1, 0, "single")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes of this job on this node (torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per node, else 1)."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 1


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConversionError(f"--part must look like K/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= k < n:
        raise ConversionError(f"--part {text}: need 0 <= K < N")
    return k, n


def detect_part(explicit: tuple[int, int] | None = None) -> tuple[int, int]:
    """This process's part: explicit, else from torchrun or srun (torchrun's variables win, see
    :mod:`ckptconv.engine.launcher`), else the whole job."""
    if explicit is not None:
        return explicit
    launch = detect_launch()
    return launch.rank, launch.world_size

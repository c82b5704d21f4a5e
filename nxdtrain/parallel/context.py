"""Context parallelism: each cp rank holds a slice of every row's sequence (the zigzag split).

A row of ``seq_len`` tokens is cut into ``2·cp`` equal chunks; cp rank ``r`` holds chunks ``r`` and
``2·cp-1-r``, one early and one late, so that under causal attention every rank does the same
amount of work (a contiguous split would give the last rank ``2·cp-1`` times the first one's).
Everything per token is split the same way: the input ids, the targets (shifted on the whole
row first, so a chunk's last token still predicts the next chunk's first) and the RoPE positions,
which stay the global ones. Attention across chunks is :mod:`nxdtrain.parallel.ring_attention`. Each rank's
loss is its tokens' sum over the global token count; summed over cp (and dp) it is the unsplit loss.

    >>> zigzag_positions(8, CpGroup(size=2, rank=0)).tolist()
    [0, 1, 6, 7]
    >>> zigzag_positions(8, CpGroup(size=2, rank=1)).tolist()
    [2, 3, 4, 5]
    >>> check_seq_len(100, cp=4, tp=1, sequence_parallel=False)[:40]
    '--seq-len 100 must be a multiple of 2 x '
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CpGroup:
    """This rank's context-parallel ring: size, rank, the process group and the ring's global ranks.

    ``ranks[i]`` is the global rank of cp rank ``i`` (point-to-point ops address peers by global rank);
    ``group`` is None when ``size`` is 1 or offline.
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    ranks: tuple[int, ...] = (0,)

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunk indices (of ``2·size``) this rank holds, in local order."""
        return self.chunks_of(self.rank)

    def chunks_of(self, cp_rank: int) -> tuple[int, int]:
        return cp_rank, 2 * self.size - 1 - cp_rank


def zigzag_positions(seq_len: int, cp: CpGroup, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of this rank's tokens, in local order (``seq_len`` is the whole row's)."""
    width = seq_len // (2 * cp.size)
    return torch.cat([torch.arange(c * width, (c + 1) * width, device=device) for c in cp.chunks])


def split_sequence(x: torch.Tensor, cp: CpGroup, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a whole-row tensor along ``dim`` (a copy; ``x`` itself when cp is 1)."""
    if cp.size == 1:
        return x
    pieces = x.chunk(2 * cp.size, dim=dim)
    first, last = cp.chunks
    return torch.cat([pieces[first], pieces[last]], dim=dim).contiguous()


def check_seq_len(seq_len: int, *, cp: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why a row of ``seq_len`` tokens cannot be split: over tp with sequence parallelism, over ``cp``'s 2·cp chunks
    (each split over tp with sequence parallelism), or None."""
    if sequence_parallel and seq_len % tp:
        return f"--sequence-parallel needs --seq-len divisible by --tp {tp}, got {seq_len}"
    if cp == 1:
        return None
    parts = 2 * cp * (tp if sequence_parallel else 1)
    if seq_len % parts == 0:
        return None
    what = f"2 x --context-parallel {cp}" + (f" x --tp {tp} (sequence parallel)" if sequence_parallel and tp > 1 else "")
    return f"--seq-len {seq_len} must be a multiple of {what} = {parts} (each cp rank holds 2 equal chunks of a row)"

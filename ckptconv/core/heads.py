"""Head order and shard-record primitives: which slice of which HF tensor sits where in an NxD shard.

This is the one place that knows the GQA head order (docs/nxd-format.md §3). The family rules
(:mod:`ckptconv.core.families.rules`) build records from these; every other module asks
:func:`q_heads` / :func:`kv_heads` or :func:`ckptconv.core.mapping.shard_records`.

A shard tensor ("record") is the concatenation along ``dim`` of *segments*, each a range of an
HF tensor along the same dim. Example: on the qkv_linear path with tp 2, kv 2, rank 1 holds
``weight_k = k_proj[8:16]`` (head 1 of head_dim 8), a record with one segment.

    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96,
    ...                  vocab=128, layers=1, tied=False)
    >>> layout = ParallelLayout(tp=4, kvm=2, attention="qkv_linear")
    >>> q_heads(spec, layout, rank=1)
    [4, 5]
    >>> kv_heads(spec, layout, rank=1)
    [1]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptconv.core.layout import Hardware, ParallelLayout, Trn2KvLayout

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec


@dataclass(frozen=True)
class Segment:
    """``hf_key[start:stop]`` along the record's dim; with ``pad``, that many zero rows instead (vocabulary padding:
    rows ``start..stop`` past the end of ``hf_key``)."""

    hf_key: str
    start: int
    stop: int
    pad: bool = False

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardRecord:
    """One tensor of one shard, described by where its rows (dim 0) or columns (dim 1) come from.

    ``slabs`` > 0: a stacked tensor (NxD's experts): the segments, in order, fall into ``slabs`` slabs of equal
    length, each slab the concatenation of its segments along ``dim`` (in HF orientation), and the tensor is the
    slabs stacked along a new first dim; ``transposed``: each slab is stored transposed (NxD's ``[in, out]``).
    """

    key: str
    dim: int
    segments: tuple[Segment, ...]
    column_major: bool = False
    at_end: bool = False  # fused/coalesced keys go after all others (official converter's order)
    slabs: int = 0
    transposed: bool = False

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.hf_key for s in self.segments))

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)


# --------------------------------------------------------------------------------------------
# Head order: the single source of truth.


def q_heads(spec: ModelSpec, layout: ParallelLayout, rank: int) -> list[int]:
    """Global Q head indices held by tp ``rank``, in the order they appear in its shard
    (docs/nxd-format.md §3, "K/V replication and Q head order")."""
    n = spec.heads // layout.tp
    if _tiled_q(spec, layout):
        i, j = divmod(rank, spec.kv_heads)
        first = j * spec.group + i * n
    else:
        first = rank * n
    return list(range(first, first + n))


def kv_heads(spec: ModelSpec, layout: ParallelLayout, rank: int) -> list[int]:
    """Global K/V head indices held by tp ``rank`` on the qkv_linear path (replicas included)."""
    kv, tp = spec.kv_heads, layout.tp
    if tp <= kv:
        per = kv // tp
        return list(range(rank * per, (rank + 1) * per))
    if _tiled_kv(layout):
        return [rank % kv]
    return [rank // layout.kvm]


def _tiled_q(spec: ModelSpec, layout: ParallelLayout) -> bool:
    """trn1 interleaves Q heads so that each rank's Q heads share its (tiled) K/V head."""
    return layout.hw is Hardware.TRN1 and layout.tp > spec.kv_heads


def _tiled_kv(layout: ParallelLayout) -> bool:
    return layout.hw is Hardware.TRN1 or layout.trn2_kv_layout is Trn2KvLayout.OFFICIAL


def head_segments(hf_key: str, heads: Iterable[int], head_dim: int) -> list[Segment]:
    return [Segment(hf_key, h * head_dim, (h + 1) * head_dim) for h in heads]


def chunk(hf_key: str, total: int, parts: int, index: int) -> Segment:
    size = total // parts
    return Segment(hf_key, index * size, (index + 1) * size)


def vocab_segments(hf_key: str, vocab: int, rows: int, parts: int, index: int) -> tuple[Segment, ...]:
    """Rank ``index``'s block of a vocabulary padded from ``vocab`` to ``rows``: its real rows, then zero rows.

        >>> vocab_segments("e", 1003, 1004, 4, 3)
        (Segment(hf_key='e', start=753, stop=1003, pad=False), Segment(hf_key='e', start=1003, stop=1004, pad=True))
    """
    block = chunk(hf_key, rows, parts, index)
    real = min(block.stop, vocab)
    out = []
    if block.start < real:
        out.append(Segment(hf_key, block.start, real))
    if real < block.stop:
        out.append(Segment(hf_key, max(block.start, real), block.stop, pad=True))
    return tuple(out)


def merge_segments(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """Join neighbours that are contiguous in the same HF tensor (fewer, larger reads)."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].hf_key == seg.hf_key and out[-1].stop == seg.start and not (out[-1].pad or seg.pad):
            out[-1] = Segment(seg.hf_key, out[-1].start, seg.stop)
        else:
            out.append(seg)
    return tuple(out)

"""Conversion plans: for every output file, its tensors in order and where each comes from.

A plan is pure index arithmetic over :mod:`ckptconv.core.mapping`; it does no I/O, so it can be
validated completely before a byte is written, and tested on shapes alone. HF->NxD, NxD->HF
and NxD->NxD are three plans run by the one executor (:mod:`ckptconv.engine.execute`).

Example:
    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96,
    ...                  vocab=128, layers=2, tied=False)
    >>> plan = plan_to_nxd(spec, ParallelLayout(tp=2), {k: torch.float32 for k in hf_shapes(spec, with_inv_freq=False)})
    >>> [f.path for f in plan.files]
    ['model/dp_rank_00_tp_rank_00_pp_rank_00.pt', 'model/dp_rank_00_tp_rank_01_pp_rank_00.pt']
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ckptconv.core.layout import Attention, ParallelLayout, ShardId, layout_shard_file
from ckptconv.core.mapping import (
    ShardRecord,
    all_ep_shard_records,
    all_shard_records,
    hf_record_shape,
    hf_shapes,
    stores_lm_head,
)
from ckptconv.core.model_spec import ModelSpec


@dataclass(frozen=True)
class Source:
    """A tensor to read: ``file`` is relative to the source root, or None for an HF key lookup."""

    file: str | None
    key: str
    # A model shard's (ep, tp, pp), where the plan names one; not part of the identity (equal sources are equal)
    shard: ShardId | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True)
class Piece:
    """``source[start:stop]`` along the record's dim; with ``alternates``, the mean of all copies.

    ``row_perm`` (rows only): the rows are taken in periods of ``len(row_perm)``, output row ``i``
    of each period being source row ``row_perm[i]`` of it (TorchTitan's RoPE order of a head).
    ``zeros``: ``stop - start`` zero rows (vocabulary padding); ``source`` only names a tensor of the dtype.
    ``slab`` >= 0: the range is of ``source[slab]`` (one expert of a stacked tensor); ``transposed``: of that
    matrix transposed (NxD's ``[in, out]`` experts read in HF orientation).
    """

    source: Source
    start: int
    stop: int
    alternates: tuple[Piece, ...] = ()
    row_perm: tuple[int, ...] = ()
    zeros: bool = False
    slab: int = -1
    transposed: bool = False

    @property
    def viewed(self) -> bool:
        """Whether the piece reads a slab or a transposed matrix (the executor's slab path)."""
        return self.slab >= 0 or self.transposed

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: the concatenation of ``pieces`` along ``dim``, cast to ``dtype``.

    ``slabs`` > 0: a stacked tensor (see :class:`ckptconv.core.heads.ShardRecord`): the pieces fall into that many
    slabs of equal length along ``dim``, each slab transposed when ``transposed``, stacked along a new first dim.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int
    pieces: tuple[Piece, ...]
    column_major: bool = False
    slabs: int = 0
    transposed: bool = False

    @property
    def by_slab(self) -> bool:
        """Whether the executor builds it slab by slab (stacked, or read from stacked sources)."""
        return bool(self.slabs) or self.transposed or any(p.viewed for p in self.pieces)

    @property
    def stride(self) -> tuple[int, ...]:
        if self.column_major:
            return (1, self.shape[0])
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        return tuple(reversed(stride))

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


NESTED_TORCH = "torch-nested"  # a torch.save zip whose ``plain`` is the whole structure, tensors placed by TensorAt


@dataclass(frozen=True)
class OutFile:
    path: str                    # relative to the output root
    format: str                  # "torch" (torch.save zip), NESTED_TORCH or "safetensors"
    tensors: tuple[OutTensor, ...]
    plain: tuple[tuple[str, Any], ...] = ()  # torch files: plain values stored before the tensors
    shard: ShardId | None = None  # a model shard's (ep, tp, pp), carried from the plan that named it

    @property
    def shard_id(self) -> ShardId:
        """:attr:`shard`, which a model shard's plan always sets."""
        assert self.shard is not None, f"{self.path}: planned without its shard identity"
        return self.shard

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ReplicaGroup:
    """Copies of one HF range held by several shards; they must be equal (K/V heads, norms, tied lm_head)."""

    hf_key: str
    dim: int
    start: int
    stop: int
    copies: tuple[Piece, ...]    # the first is the one exported


@dataclass
class Plan:
    files: list[OutFile]
    replicas: list[ReplicaGroup] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


DtypePolicy = Callable[[str, torch.dtype], torch.dtype]


def keep_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    return dtype


def cast_floats_to(target: torch.dtype) -> DtypePolicy:
    """Cast floating weights to ``target``; rotary ``inv_freq`` buffers keep their precision."""

    def policy(key: str, dtype: torch.dtype) -> torch.dtype:
        if key.endswith("inv_freq") or not dtype.is_floating_point:
            return dtype
        return target

    return policy


# --------------------------------------------------------------------------------------------
# HF -> NxD


def plan_to_nxd(
    spec: ModelSpec,
    layout: ParallelLayout,
    source_dtypes: dict[str, torch.dtype],
    dtype_policy: DtypePolicy = keep_dtype,
) -> Plan:
    """Shards for ``layout`` from an HF state whose keys and dtypes are ``source_dtypes``."""
    layout = replace(layout, with_inv_freq=any(k.endswith("inv_freq") for k in source_dtypes))  # as the source
    shapes = hf_shapes(spec, with_inv_freq=layout.with_inv_freq)
    files = []
    # pp-major, like NxD's rank order (all_shard_records' order): the executor finishes, and
    # hashes, files in this order.
    for (ep, tp, pp), records in all_ep_shard_records(spec, layout).items():
        tensors = tuple(
            _out_tensor(record, shapes, source_dtypes, dtype_policy, lambda key: Source(None, key))
            for record in records
        )
        files.append(OutFile(layout_shard_file(layout, ep_rank=ep, tp_rank=tp, pp_rank=pp), "torch", tensors,
                             shard=ShardId(ep, tp, pp)))
    return Plan(files)


def _out_tensor(
    record: ShardRecord,
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    dtype_policy: DtypePolicy,
    source_of: Callable[[str], Source],
) -> OutTensor:
    first = record.segments[0].hf_key
    pieces = tuple(Piece(source_of(s.hf_key), s.start, s.stop, zeros=s.pad) for s in record.segments)
    return OutTensor(
        key=record.key,
        dtype=dtype_policy(record.key, dtypes[first]),
        shape=hf_record_shape(record, shapes[first]),
        dim=record.dim,
        pieces=pieces,
        column_major=record.column_major,
        slabs=record.slabs,
        transposed=record.transposed,
    )


# --------------------------------------------------------------------------------------------
# NxD -> HF


@dataclass(frozen=True)
class _Placement:
    hf_key: str
    dim: int
    start: int
    stop: int
    piece: Piece  # where in the shards this HF range lives


def _placements(spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool) -> dict[str, list[_Placement]]:
    """Every HF range's locations in the shards, grouped by HF key, in rank order."""
    out: dict[str, list[_Placement]] = defaultdict(list)
    records_of = all_ep_shard_records(spec, layout, lm_head_copy=lm_head_copy)
    for (ep, tp, pp), records in records_of.items():
        file = layout_shard_file(layout, ep_rank=ep, tp_rank=tp, pp_rank=pp)
        for record in records:
            slab_length = record.length // max(record.slabs, 1)
            offset = 0
            for seg in record.segments:
                slab, at = divmod(offset, slab_length) if record.slabs else (-1, offset)
                if not seg.pad:  # padding rows are no HF range
                    piece = Piece(Source(file, record.key, shard=ShardId(ep, tp, pp)), at, at + seg.length, slab=slab,
                                  transposed=record.transposed)
                    out[seg.hf_key].append(_Placement(seg.hf_key, record.dim, seg.start, seg.stop, piece))
                offset += seg.length
    return out


def hf_sources(
    spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool = True
) -> tuple[dict[str, tuple[int, tuple[Piece, ...]]], list[ReplicaGroup]]:
    """For each HF key: (dim, pieces that tile it, first copy of each range); plus all replica groups.

    ``lm_head_copy``: whether a tied model's shards hold ``lm_head.weight`` (see
    :func:`ckptconv.core.mapping.stores_lm_head`); ignored when untied. Raises if the shards do not
    cover some HF range exactly once (an internal inconsistency).
    """
    shapes = hf_shapes(spec, with_inv_freq=layout.with_inv_freq)
    tiles: dict[str, tuple[int, tuple[Piece, ...]]] = {}
    replicas: list[ReplicaGroup] = []
    for hf_key, placements in _placements(spec, layout, lm_head_copy=lm_head_copy).items():
        by_range: dict[tuple[int, int], list[_Placement]] = {}
        for p in placements:
            by_range.setdefault((p.start, p.stop), []).append(p)
        ranges = sorted(by_range)
        dim = placements[0].dim
        expected_end = shapes[hf_key][dim]
        cursor = 0
        for start, stop in ranges:
            if start != cursor:
                raise AssertionError(f"{hf_key}: shard ranges leave a gap or overlap at {cursor}..{start}")
            cursor = stop
        if cursor != expected_end:
            raise AssertionError(f"{hf_key}: shards cover {cursor} of {expected_end} along dim {dim}")
        tiles[hf_key] = (dim, tuple(by_range[r][0].piece for r in ranges))
        for (start, stop), copies in by_range.items():
            if len(copies) > 1:
                replicas.append(ReplicaGroup(hf_key, dim, start, stop, tuple(c.piece for c in copies)))
    return tiles, replicas


def plan_to_hf(
    spec: ModelSpec,
    layout: ParallelLayout,
    shard_dtypes: dict[str, torch.dtype],
    *,
    max_shard_size: int = 5 * 10**9,
    dtype_policy: DtypePolicy = keep_dtype,
    average_replicas: bool = False,
    fused_experts: bool = False,
) -> Plan:
    """Sharded safetensors files (HF naming and grouping) from NxD shards.

    ``shard_dtypes`` maps NxD keys to their stored dtype. With ``average_replicas`` a replicated
    range (K/V head, norm, tied lm_head) is exported as the mean of its copies. ``fused_experts``: a mixture of
    experts' layers in transformers' fused form (:mod:`ckptconv.core.fused_experts`).
    """
    tensors = _hf_tensors(spec, layout, shard_dtypes, dtype_policy, column_major_o=False)
    _, replicas = hf_sources(spec, layout, lm_head_copy=stores_lm_head(spec, shard_dtypes))
    if average_replicas:
        tensors = [_with_alternates(t, replicas) for t in tensors]
    if fused_experts:
        from ckptconv.core.fused_experts import fuse_experts  # it builds on this module's tensors

        tensors = fuse_experts(spec, list(tensors))
    return Plan(hf_files(tensors, max_shard_size), replicas)


def hf_files(tensors: Iterable[OutTensor], max_shard_size: int) -> list[OutFile]:
    """HF's safetensors files for ``tensors`` in order: one ``model.safetensors``, or
    ``model-0000K-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes."""
    groups = group_by_size(tensors, max_shard_size)
    if len(groups) == 1:
        return [OutFile("model.safetensors", "safetensors", tuple(groups[0]))]
    return [OutFile(f"model-{i:05d}-of-{len(groups):05d}.safetensors", "safetensors", tuple(group))
            for i, group in enumerate(groups, start=1)]


def _with_alternates(tensor: OutTensor, replicas: list[ReplicaGroup]) -> OutTensor:
    copies = {g.copies[0]: g.copies[1:] for g in replicas if g.hf_key == tensor.key}
    if not copies:
        return tensor
    pieces = tuple(Piece(p.source, p.start, p.stop, copies.get(p, ()), p.row_perm, slab=p.slab,
                         transposed=p.transposed) for p in tensor.pieces)
    return OutTensor(tensor.key, tensor.dtype, tensor.shape, tensor.dim, pieces, tensor.column_major)


def plan_to_full_state(
    spec: ModelSpec,
    layout: ParallelLayout,
    shard_dtypes: dict[str, torch.dtype],
    *,
    filename: str = "checkpoint.pt",
) -> Plan:
    """The official ``--convert_to_full_state`` output: one torch file with HF keys.

    Its key order is the official one: shards read tp rank 0 first, pp ascending, each NxD key
    (in the shard order of :func:`ckptconv.core.mapping.shard_records`) expanded in place into its HF
    keys. A tied model gets no ``lm_head.weight``, with or without a copy in the shards.
    """
    tensors = {t.key: t for t in _hf_tensors(spec, layout, shard_dtypes, keep_dtype,
                                             column_major_o=layout.attention is Attention.QKV_LINEAR)}
    ordered: list[OutTensor] = []
    seen: set[str] = set()
    # every expert in its module slot, as at ep 1 (the pieces still read each expert from its ep rank's shards)
    records = all_shard_records(spec, replace(layout, ep=1),
                                lm_head_copy=stores_lm_head(spec, shard_dtypes))
    for pp in range(layout.pp):
        for record in records[(0, pp)]:
            for hf_key in record.hf_keys:
                if hf_key not in seen and hf_key in tensors:
                    seen.add(hf_key)
                    ordered.append(tensors[hf_key])
    return Plan([OutFile(filename, "torch", tuple(ordered))])


def _hf_tensors(
    spec: ModelSpec,
    layout: ParallelLayout,
    shard_dtypes: dict[str, torch.dtype],
    dtype_policy: DtypePolicy,
    *,
    column_major_o: bool,
) -> list[OutTensor]:
    shapes = hf_shapes(spec, with_inv_freq=layout.with_inv_freq)
    tiles, _ = hf_sources(spec, layout, lm_head_copy=stores_lm_head(spec, shard_dtypes))
    out = []
    for hf_key, shape in shapes.items():
        dim, pieces = tiles[hf_key]
        source_dtype = shard_dtypes[pieces[0].source.key]
        out.append(
            OutTensor(
                key=hf_key,
                dtype=dtype_policy(hf_key, source_dtype),
                shape=shape,
                dim=dim,
                pieces=pieces,
                column_major=column_major_o and hf_key.endswith("o_proj.weight"),
            )
        )
    return out


def group_by_size(tensors: Iterable[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Fill files in order, starting a new one when the next tensor would pass ``max_bytes``."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


# --------------------------------------------------------------------------------------------
# NxD -> NxD


def plan_reshard(
    spec: ModelSpec,
    old: ParallelLayout,
    new: ParallelLayout,
    shard_dtypes: dict[str, torch.dtype],
    *,
    dtype_policy: DtypePolicy = keep_dtype,
) -> Plan:
    """Shards for ``new`` read straight from shards in ``old``: the to-hf plan composed with to-nxd.

    A tied model's target shards get our ``lm_head.weight`` copy whether the source has one or not.
    """
    tiles, replicas = hf_sources(spec, old, lm_head_copy=stores_lm_head(spec, shard_dtypes))
    hf_dtypes = {key: shard_dtypes[pieces[0].source.key] for key, (_, pieces) in tiles.items()}
    target = plan_to_nxd(spec, new, hf_dtypes, dtype_policy)
    files = [
        replace(f, tensors=tuple(compose(t, tiles) for t in f.tensors))
        for f in target.files
    ]
    return Plan(files, replicas)


def compose(tensor: OutTensor, tiles: Mapping[str, tuple[int | None, tuple[Piece, ...]]]) -> OutTensor:
    """``tensor`` read from where its HF sources lie (``tiles``: see :func:`hf_sources` for shards,
    :func:`ckptconv.titan.plans.titan_tiles` for TorchTitan tensors).

    A tile of dim ``None`` is the whole HF tensor under another name (or one slab of a stacked one): any range
    of it, along any dim, is the same range there. Rows permuted in periods (``row_perm``, on the piece or on
    the tile) are kept; a period never straddles two pieces (they are whole heads).
    """
    pieces: list[Piece] = []
    for piece in tensor.pieces:
        dim, old_pieces = tiles[piece.source.key]
        if piece.zeros:  # padding: read nothing, but name a source the new reader has (for the dtype)
            pieces.append(Piece(old_pieces[0].source, piece.start, piece.stop, zeros=True))
            continue
        if dim is None:
            (whole,) = old_pieces  # a slab of a stacked tensor (TorchTitan's experts) is whole too
            pieces.append(Piece(whole.source, piece.start, piece.stop, row_perm=piece.row_perm, slab=whole.slab,
                                transposed=whole.transposed))
            continue
        if dim != tensor.dim:
            raise AssertionError(f"{tensor.key}: split along dim {tensor.dim} but stored along {dim}")
        hf_cursor = 0
        for old in old_pieces:
            lo, hi = max(piece.start, hf_cursor), min(piece.stop, hf_cursor + old.length)
            if lo < hi:
                if piece.row_perm and old.row_perm:
                    raise AssertionError(f"{tensor.key}: rows of {piece.source.key} permuted twice")
                perm, origin = (piece.row_perm, piece.start) if piece.row_perm else (old.row_perm, hf_cursor)
                period = len(perm) or 1
                if (lo - origin) % period or (hi - lo) % period:
                    raise AssertionError(f"{tensor.key}: rows {lo}..{hi} of {piece.source.key} cut a period of {period}")
                shift = old.start - hf_cursor
                pieces.append(Piece(old.source, lo + shift, hi + shift, row_perm=perm, slab=old.slab,
                                    transposed=old.transposed))
            hf_cursor += old.length
    return OutTensor(tensor.key, tensor.dtype, tensor.shape, tensor.dim, _merge(pieces), tensor.column_major,
                     tensor.slabs, tensor.transposed)


def _merge(pieces: list[Piece]) -> tuple[Piece, ...]:
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and last.source == p.source and last.stop == p.start and last.row_perm == p.row_perm
                and not (last.zeros or p.zeros) and (last.slab, last.transposed) == (p.slab, p.transposed)):
            out[-1] = Piece(p.source, last.start, p.stop, row_perm=p.row_perm, slab=p.slab, transposed=p.transposed)
        else:
            out.append(p)
    return tuple(out)

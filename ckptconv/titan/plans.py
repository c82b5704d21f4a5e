"""Plans into and out of TorchTitan's DCP layout: the rule table of :mod:`ckptconv.titan.names` as plans.

Into DCP, every TorchTitan tensor is a list of HF row ranges (q/k rows permuted head by head); from
NxD shards the same plan is composed with where those HF ranges lie in the shards. Out of DCP, the
HF (or NxD) plan reads each HF range from its TorchTitan tensor with the inverse permutation. Nothing
here assumes a weight: ``key_of`` and ``source_of`` route any per-parameter tensor (an AdamW moment
keyed ``optimizer.state.<param>.exp_avg``, say) through the same rules.

    >>> plan = plan_to_dcp(spec, hf_dtypes)                       # doctest: +SKIP
    >>> [t.key for t in plan.files[0].tensors][:2]                # doctest: +SKIP
    ['tok_embeddings.weight', 'layers.0.attention.qkv_linear.wq.weight']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.mapping import EMBED, hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import (
    DtypePolicy,
    OutFile,
    OutTensor,
    Piece,
    Plan,
    ReplicaGroup,
    Source,
    compose,
    group_by_size,
    hf_files,
    keep_dtype,
    plan_to_nxd,
)
from ckptconv.engine.options import DEFAULT_DCP_FILE_SIZE as DEFAULT_FILE_SIZE  # re-exported: dcp_convert
from ckptconv.errors import ConversionError
from ckptconv.io.dcp import distcp_name
from ckptconv.titan.names import (
    OPTIMIZER_STATE_FIELDS,
    TitanParam,
    inverse_rows,
    optimizer_key,
    rope_rows,
    shared_copies,
    titan_params,
    trained_params,
)
from ckptconv.training.nxdtrain_format.state import OptimizerSource, optimizer_files, state_key, state_tensors

Tiles = Mapping[str, tuple[int | None, tuple[Piece, ...]]]


def titan_tensor(param: TitanParam, spec: ModelSpec, dtype: torch.dtype, *, key: str | None = None,
                 source_of: Callable[[str], Source] = lambda hf_key: Source(None, hf_key)) -> OutTensor:
    """One TorchTitan tensor (under ``key``, default its parameter name) from HF-keyed sources (stacked experts
    slab by slab; a buffer fp32 zeros)."""
    perm = rope_rows(spec.head_dim)
    pieces = tuple(Piece(source_of(p.hf_key), p.start, p.stop, row_perm=perm if p.rope else (), zeros=p.zeros,
                         slab=p.slab, transposed=p.transposed) for p in param.pieces)
    return OutTensor(key or param.key, torch.float32 if param.buffer else dtype, param.shape, param.dim, pieces,
                     slabs=param.slabs)


def plan_to_dcp(
    spec: ModelSpec,
    source_dtypes: dict[str, torch.dtype],
    *,
    dtype_policy: DtypePolicy = keep_dtype,
    max_file_size: int = DEFAULT_FILE_SIZE,
    tiles: Tiles | None = None,
    replicas: list[ReplicaGroup] | None = None,
    state: Sequence[OutTensor] = (),
) -> Plan:
    """TorchTitan's model keys (then ``state``: optimizer tensors) in ``.distcp`` files of at most
    ``max_file_size`` bytes.

    ``source_dtypes`` is keyed by HF name; with ``tiles`` (:func:`ckptconv.core.plan.hf_sources` of NxD
    shards) each HF range is read from the shards holding it, and ``replicas`` are checked.
    """
    tensors = []
    for param in titan_params(spec):
        dtype = dtype_policy(param.key, source_dtypes[param.pieces[0].hf_key])
        tensor = titan_tensor(param, spec, dtype)
        tensors.append(tensor if tiles is None else _from_shards(tensor, tiles))
    tensors += state
    files = [OutFile(distcp_name(i), "dcp", tuple(group)) for i, group in enumerate(group_by_size(tensors, max_file_size))]
    return Plan(files, list(replicas or []))


def plan_titan_optimizer(spec: ModelSpec, tiles: Tiles, optim: OptimizerSource) -> list[OutTensor]:
    """TorchTitan's AdamW tensors (``optimizer.state.<param>.{step,exp_avg,exp_avg_sq}``) of every trained
    parameter (fused ``wqkv`` included), read from a training tag's optimizer files exactly as the parameter's
    rows are read from its shards: a moment is fused and RoPE-permuted like its weight."""
    tensors = []
    for param in trained_params(spec):
        weight = _from_shards(titan_tensor(param, spec, torch.float32), tiles)
        state = state_tensors(weight, optim)
        missing = [c for c in OPTIMIZER_STATE_FIELDS if c not in state]
        if missing:
            raise ConversionError(f"{getattr(optim, 'root', 'the tag')}: no AdamW {missing[0]} for {param.key} (the tag's optimizer state "
                                  f"has {', '.join(state) or 'nothing'}); TorchTitan's checkpoint needs AdamW state: "
                                  "pass --weights-only for the model alone")
        tensors += [dataclasses.replace(state[c], key=optimizer_key(param.key, c)) for c in OPTIMIZER_STATE_FIELDS]
    return tensors


def _from_shards(tensor: OutTensor, tiles: Tiles) -> OutTensor:
    """``tensor`` read from NxD shards; a whole tensor the shards split by columns is read by columns (stacked
    experts are planned along the dim their shards split)."""
    dims = {tiles[p.source.key][0] for p in tensor.pieces}
    if dims == {1} and not tensor.slabs:
        (piece,) = tensor.pieces
        if piece.row_perm or (piece.start, piece.stop) != (0, tensor.shape[0]):
            raise AssertionError(f"{tensor.key}: only whole, unpermuted tensors are read by columns")
        whole = Piece(piece.source, 0, tensor.shape[1])
        tensor = OutTensor(tensor.key, tensor.dtype, tensor.shape, 1, (whole,), tensor.column_major)
    return compose(tensor, tiles)


def hf_dtypes_of(tiles: Tiles, shard_dtypes: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """dtype of each HF key as the shards store it."""
    return {key: shard_dtypes[pieces[0].source.key] for key, (_, pieces) in tiles.items()}


# --------------------------------------------------------------------------------------------
# Out of DCP


def titan_tiles(params: Iterable[TitanParam], spec: ModelSpec,
                source_of: Callable[[str], Source] = lambda key: Source(None, key)) -> Tiles:
    """Where each HF row range lies in TorchTitan tensors (the rule table read backwards), in the form
    :func:`ckptconv.core.plan.hf_sources` gives for shards, so any HF-keyed plan composes with it.

    ``source_of(titan_key)`` names the tensor to read (a moment's key, say). A whole, unpermuted tensor
    is a tile of dim ``None`` (any range, along any dim); a range held twice (a tied ``lm_head``) is
    read from its first holder.
    """
    inverse = inverse_rows(rope_rows(spec.head_dim))
    ranges: dict[str, list[tuple[int, Piece]]] = {}
    whole: dict[str, Piece] = {}
    for param in params:
        if all(p.zeros for p in param.pieces):
            continue  # no HF tensor comes from it
        if param.slabs and param.pieces[0].transposed:  # HF's stacked experts: read by stacked_from_dcp
            continue
        if param.slabs:  # stacked experts: each HF tensor is one whole slab
            for e, p in enumerate(param.pieces):
                whole.setdefault(p.hf_key, Piece(source_of(param.key), 0, p.stop - p.start, slab=e))
            continue
        offset = 0
        for p in param.pieces:
            length = p.stop - p.start
            if not p.rope and len(param.pieces) == 1 and (p.start, p.stop) == (0, param.shape[0]):
                whole.setdefault(p.hf_key, Piece(source_of(param.key), 0, length))
            elif all(start != p.start for start, _ in ranges.get(p.hf_key, [])):
                piece = Piece(source_of(param.key), offset, offset + length, row_perm=inverse if p.rope else ())
                ranges.setdefault(p.hf_key, []).append((p.start, piece))
            offset += length
    tiles: dict[str, tuple[int | None, tuple[Piece, ...]]] = {key: (None, (p,)) for key, p in whole.items()}
    for key, found in ranges.items():
        tiles[key] = (0, tuple(piece for _, piece in sorted(found, key=lambda f: f[0])))
    return tiles


def hf_dtypes_from_dcp(spec: ModelSpec, dcp_dtypes: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """dtype of each HF key (no ``lm_head`` when tied) as the TorchTitan tensor it comes from stores it."""
    held: dict[str, torch.dtype] = {}
    for param in titan_params(spec):
        for piece in param.pieces:
            if not piece.zeros:
                held.setdefault(piece.hf_key, dcp_dtypes[param.key])
    for copy, of in shared_copies(spec).items():
        held[copy] = held[of]
    return {key: held[key] for key in hf_shapes(spec, with_inv_freq=False)}


def tied_copies(spec: ModelSpec) -> ReplicaGroup | None:
    """A tied model's TorchTitan checkpoint holds the embedding twice (one tensor under two names)."""
    if not spec.tied:
        return None
    copies = (Piece(Source(None, "tok_embeddings.weight"), 0, spec.vocab), Piece(Source(None, "lm_head.weight"), 0, spec.vocab))
    return ReplicaGroup(EMBED, 0, 0, spec.vocab, copies)


def _stacked(tensor: OutTensor, held: dict[str, TitanParam]) -> OutTensor | None:
    """An HF tensor stacked ``[E, in, out]`` (GPT-OSS's experts; ``held``: the TorchTitan tensor holding each, by HF
    key) read slab by slab, each slab transposed; None for any other tensor."""
    param = held.get(tensor.key)
    if param is None:
        return None
    pieces = tuple(Piece(Source(None, param.key), 0, tensor.shape[1], slab=e, transposed=True) for e in range(param.slabs))
    return dataclasses.replace(tensor, pieces=pieces, slabs=param.slabs)


def _read_from_dcp(plan: Plan, spec: ModelSpec) -> Plan:
    """A plan over HF-keyed sources, reading each range from its TorchTitan tensor instead."""
    params = titan_params(spec)
    tiles = titan_tiles(params, spec)
    for copy, of in shared_copies(spec).items():  # an HF tensor TorchTitan keeps once (DeepSeek-V3's MTP embedding)
        tiles = {**tiles, copy: tiles[of]}
    held = {p.pieces[0].hf_key: p for p in params if p.slabs and p.pieces[0].transposed}
    files = [dataclasses.replace(f, tensors=tuple(_stacked(t, held) or compose(t, tiles) for t in f.tensors))
             for f in plan.files]
    return Plan(files, plan.replicas)


def plan_dcp_to_hf(spec: ModelSpec, dcp_dtypes: dict[str, torch.dtype], *, max_shard_size: int = 5 * 10**9,
                   dtype_policy: DtypePolicy = keep_dtype) -> Plan:
    """HF safetensors files from TorchTitan's model keys."""
    dtypes = hf_dtypes_from_dcp(spec, dcp_dtypes)
    hf_plan = whole_hf_plan(spec, dtypes, max_shard_size, dtype_policy)
    return _read_from_dcp(hf_plan, spec)


def whole_hf_plan(spec: ModelSpec, dtypes: dict[str, torch.dtype], max_shard_size: int,
                  dtype_policy: DtypePolicy) -> Plan:
    """The HF files, each tensor one whole HF-keyed piece (the rows are then remapped)."""
    shapes = hf_shapes(spec, with_inv_freq=False)
    tensors = [OutTensor(key, dtype_policy(key, dtypes[key]), shape, 0, (Piece(Source(None, key), 0, shape[0]),))
               for key, shape in shapes.items()]
    return Plan(hf_files(tensors, max_shard_size))


def plan_dcp_to_nxd(spec: ModelSpec, layout: ParallelLayout, dcp_dtypes: dict[str, torch.dtype], *,
                    dtype_policy: DtypePolicy = keep_dtype) -> Plan:
    """NxD shards of ``layout`` from TorchTitan's model keys (the to-nxd plan, read from DCP)."""
    plan = plan_to_nxd(spec, layout, hf_dtypes_from_dcp(spec, dcp_dtypes), dtype_policy)
    return _read_from_dcp(plan, spec)


def plan_dcp_to_tag(spec: ModelSpec, layout: ParallelLayout, dcp_dtypes: dict[str, torch.dtype],
                    param_groups: list[dict[str, Any]], *, dp: int = 1, zero1: bool = False,
                    dtype_policy: DtypePolicy = keep_dtype) -> Plan:
    """An nxdtrain training tag's shards and format-2 optimizer files from a full TorchTitan checkpoint.

    Each shard tensor's AdamW moments are its HF rows read from TorchTitan's optimizer tensors through
    the same table backwards (the fused ``wqkv`` split, RoPE rows restored); ``step`` is its trained
    parameter's. The moments keep their stored dtype.
    """
    hf_plan = plan_to_nxd(spec, layout, hf_dtypes_from_dcp(spec, dcp_dtypes), dtype_policy)
    shards = _read_from_dcp(hf_plan, spec).files
    def reader(component: str) -> Callable[[str], Source]:
        return lambda key: Source(None, optimizer_key(key, component))

    moments = {c: titan_tiles(trained_params(spec), spec, source_of=reader(c)) for c in OPTIMIZER_STATE_FIELDS if c != "step"}
    hf_tensor = {(f.path, t.key): t for f in hf_plan.files for t in f.tensors}

    def state_of(path: str, weight: OutTensor) -> dict[str, OutTensor]:
        read = {c: compose(hf_tensor[(path, weight.key)], tiles) for c, tiles in moments.items()}
        first = read["exp_avg"].pieces[0].source.key
        step = first[:-len("exp_avg")] + "step"  # the trained parameter's step (one per parameter)
        out = {"step": OutTensor(state_key(weight.key, "step"), dcp_dtypes[step], (), 0, (Piece(Source(None, step), 0, 1),))}
        for c, t in read.items():
            out[c] = dataclasses.replace(t, key=state_key(weight.key, c), dtype=dcp_dtypes[t.pieces[0].source.key])
        return out

    return Plan(shards + optimizer_files(shards, state_of, param_groups, dp=dp, zero1=zero1), hf_plan.replicas)

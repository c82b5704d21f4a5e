"""Recover the parallel layout of NxD shards that carry no ``ckptconv.json``.

tp and pp come from file names, the attention mode from key names, kvm from the K/V rows per
rank, vpp from which layers each pp rank holds, and trn1 vs trn2 from which ranks hold equal
K/V replicas (tiled replicas fit both trn1 and the official converter's trn2, so they are refused
unless ``--hw-backend`` says which). Every inference is reported as a note so the user sees what
was assumed.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ckptconv.core.layout import Attention, Hardware, ParallelLayout, Trn2KvLayout, layer_pp_ranks
from ckptconv.core.layout_flags import LayoutOverrides
from ckptconv.core.mapping import EMBED
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.errors import AmbiguousLayout, ConversionError
from ckptconv.io.metadata import METADATA_FILE
from ckptconv.io.nxd_read import NxdCheckpoint

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def infer_layout(ckpt: NxdCheckpoint, spec: ModelSpec, hints: LayoutOverrides) -> tuple[ParallelLayout, list[str]]:
    """The layout of ``ckpt``; ``hints`` (flag values the user gave) win over inference, except where
    the K/V replica order contradicts them (then they are refused)."""
    notes: list[str] = []
    keys = ckpt.keys(sorted(ckpt.files)[0])
    attention, fused = _attention_mode(keys)
    layout = ParallelLayout(tp=ckpt.tp, pp=ckpt.pp, attention=attention, fuse_qkv=fused)
    notes.append(f"tp {ckpt.tp} and pp {ckpt.pp} from file names; attention {attention.value}"
                 + (" (fused weight_qkv)" if fused else "") + " from key names")
    padded = _stored_vocab_rows(ckpt)
    if padded != spec.vocab:
        layout = replace(layout, padded_vocab=padded)
        notes.append(f"embedding padded to {padded} rows (vocab_size {spec.vocab}) from its shard shape")
    vpp = _infer_vpp(ckpt, spec, layout)
    layout = replace(layout, vpp=vpp)
    if vpp > 1:
        notes.append(f"vpp {vpp} from the layers each pp rank holds")
    if attention is Attention.QKV_LINEAR:
        kvm = _infer_kvm(ckpt, spec, layout)
        layout = replace(layout, kvm=kvm)
        notes.append(f"kv_size_multiplier {kvm} from K/V rows per rank")
        if replicas_tell_layout(spec, layout):
            layout, note = _infer_hw(ckpt, spec, layout, hints)
            notes.append(note)
    overrides = hints.given()
    if overrides:
        layout = replace(layout, **overrides)  # type: ignore[arg-type]
        notes.append("given on the command line: " + ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in overrides.items()))
    layout.check_model(spec)
    return layout, notes


def _stored_vocab_rows(ckpt: NxdCheckpoint) -> int:
    """Embedding rows over all tp ranks, as stored (another tool may have padded them, NxDT to 128 x tp)."""
    file = ckpt.file_of(tp_rank=0, pp_rank=0)
    if EMBED not in ckpt.keys(file):
        raise ConversionError(f"{ckpt.files[file]}: missing {EMBED!r}")
    _, shape, _ = ckpt.info(Source(file, EMBED))
    return shape[0] * ckpt.tp


def _attention_mode(keys: list[str]) -> tuple[Attention, bool]:
    if any(k.endswith("qkv_proj.weight_qkv") for k in keys):
        return Attention.QKV_LINEAR, True
    if any(k.endswith("qkv_proj.weight_q") for k in keys):
        return Attention.QKV_LINEAR, False
    if any(k.endswith("self_attn.qkv_proj.weight") for k in keys):
        return Attention.COALESCED, False
    if any(k.endswith("self_attn.q_proj.weight") for k in keys):
        return Attention.SEPARATE, False
    raise ConversionError(
        f"cannot tell the attention mode: no q_proj, qkv_proj.weight, weight_q or weight_qkv key among {len(keys)} keys"
    )


def _layers_by_pp(ckpt: NxdCheckpoint) -> list[int]:
    owner: dict[int, int] = {}
    for pp in range(ckpt.pp):  # tp rank 0 holds every layer of its stage
        file = ckpt.file_of(tp_rank=0, pp_rank=pp)
        for key in ckpt.keys(file):
            m = _LAYER_RE.match(key)
            if m:
                owner[int(m.group(1))] = pp
    return [owner[i] for i in sorted(owner)]


def _infer_vpp(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout) -> int:
    observed = _layers_by_pp(ckpt)
    if len(observed) != spec.layers:
        raise ConversionError(
            f"{ckpt.model_dir}: shards hold {len(observed)} layers, config.json says {spec.layers}"
        )
    for vpp in range(1, spec.layers // layout.pp + 1):
        if layer_pp_ranks(spec.layers, replace(layout, vpp=vpp)) == observed:
            return vpp
    raise ConversionError(f"{ckpt.model_dir}: the layers' pp ranks match no pipeline split with pp {layout.pp}")


def _kv_rows_per_rank(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, file: str, prefix: str) -> int:
    n_rows = spec.heads // layout.tp * spec.head_dim
    if layout.fuse_qkv:
        _, shape, _ = ckpt.info(Source(file, prefix + "weight_qkv"))
        return (shape[0] - n_rows) // 2
    _, shape, _ = ckpt.info(Source(file, prefix + "weight_k"))
    return shape[0]


def _first_layer_prefix(ckpt: NxdCheckpoint, file: str) -> str:
    for key in ckpt.keys(file):
        m = _LAYER_RE.match(key)
        if m:
            return f"model.layers.{m.group(1)}.self_attn.qkv_proj."
    raise ConversionError(f"{file}: no decoder layer found")


def _infer_kvm(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout) -> int:
    file = sorted(ckpt.files)[0]
    rows = _kv_rows_per_rank(ckpt, spec, layout, file, _first_layer_prefix(ckpt, file))
    total = rows * layout.tp
    if total % spec.kv_rows:
        raise ConversionError(
            f"{file}: {rows} K/V rows per rank do not fit {spec.kv_heads} KV heads x head_dim {spec.head_dim}"
        )
    return max(1, total // spec.kv_rows)


def _k_rows(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
    file = ckpt.file_of(tp_rank=tp_rank, pp_rank=0)
    prefix = _first_layer_prefix(ckpt, file)
    if layout.fuse_qkv:
        n_rows = spec.heads // layout.tp * spec.head_dim
        return ckpt.read_rows(Source(file, prefix + "weight_qkv"), n_rows, n_rows + spec.head_dim)
    return ckpt.read_rows(Source(file, prefix + "weight_k"), 0, spec.head_dim)


# The two K/V replica orders a qkv_linear shard set can have (docs/nxd-format.md §3)
ADJACENT = "adjacent"  # K_(r div kvm): the trn2 runtime layout
TILED = "tiled"        # K_(r mod kv): trn1, and trn2 as the official converter writes it


def expected_order(layout: ParallelLayout) -> str:
    return ADJACENT if layout.hw is Hardware.TRN2 and layout.trn2_kv_layout is Trn2KvLayout.RUNTIME else TILED


def _describe_order(order: str) -> str:
    return ("on adjacent ranks (the trn2 runtime layout)" if order == ADJACENT
            else "tiled across ranks (trn1, or trn2 as the official converter writes it)")


def replicas_tell_layout(spec: ModelSpec, layout: ParallelLayout) -> bool:
    """Whether the K/V replica order depends on the hardware layout (kvm > 1 with several KV heads)."""
    return layout.attention is Attention.QKV_LINEAR and layout.kvm > 1 and spec.kv_heads > 1


def replica_orders(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout) -> set[str]:
    """The replica orders the first layer's K heads fit, over every tp rank (empty: the copies differ)."""
    heads = [_k_rows(ckpt, spec, layout, rank) for rank in range(layout.tp)]
    orders = set()
    if all(torch.equal(heads[r], heads[r - r % layout.kvm]) for r in range(layout.tp)):
        orders.add(ADJACENT)
    if all(torch.equal(heads[r], heads[r % spec.kv_heads]) for r in range(layout.tp)):
        orders.add(TILED)
    return orders


def check_replica_order(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, where: str) -> None:
    """Refuse a layout whose K/V replica order the shards contradict (the other order fits instead):
    exporting with it would pair query heads with the wrong K/V heads."""
    if not replicas_tell_layout(spec, layout):
        return
    expected = expected_order(layout)
    orders = replica_orders(ckpt, spec, layout)
    if expected not in orders and orders:
        raise ConversionError(
            f"{ckpt.model_dir}: the K/V replicas sit {_describe_order(next(iter(orders)))}, but the layout "
            f"({where}: hw {layout.hw.value}, trn2_kv_layout {layout.trn2_kv_layout.value}) puts them "
            f"{_describe_order(expected)}; the layout flags are wrong (--hw-backend, --trn2-kv-layout), "
            "not the weights"
        )


def _infer_hw(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout,
              hints: LayoutOverrides) -> tuple[ParallelLayout, str]:
    """trn1 vs trn2 from the K/V replica order, checked against ``--hw-backend``/``--trn2-kv-layout`` when given.

    Tiled replicas are what trn1 and the official converter's trn2 both write; the two differ only in
    query-head order, which no weight shows, so without flags they are refused, never guessed.
    """
    orders = replica_orders(ckpt, spec, layout)
    given = {k: hints[k] for k in ("hw", "trn2_kv_layout") if hints.get(k) is not None}
    hw, kv_layout = hints.flag("hw"), hints.flag("trn2_kv_layout")
    if given:
        told = replace(layout, **given)  # type: ignore[arg-type]
        expected = expected_order(told)
        if orders and expected not in orders:
            raise ConversionError(
                f"{ckpt.model_dir}: the K/V replicas sit {_describe_order(next(iter(orders)))}, but "
                + " ".join(f"{hints.flag(k)} {getattr(v, 'value', v)}" for k, v in given.items())
                + f" puts them {_describe_order(expected)}; these layout flags are wrong, not the weights "
                + (f"(pass {hw} trn2 alone)" if ADJACENT in orders else
                   f"(pass {hw} trn1, or {hw} trn2 {kv_layout} official)")
            )
        how = "fits" if orders else "was given; the copies differ, so the export checks every one"
        return told, f"K/V replica order {how} " + ", ".join(f"{hints.flag(k)} {getattr(v, 'value', v)}"
                                                            for k, v in given.items())
    if orders == {ADJACENT}:
        return replace(layout, hw=Hardware.TRN2, trn2_kv_layout=Trn2KvLayout.RUNTIME), \
            "trn2 from K/V replicas on adjacent ranks"
    if orders == {TILED}:
        raise AmbiguousLayout(
            f"{ckpt.model_dir}: no {METADATA_FILE}, and the K/V replicas are tiled across ranks: written for trn1, "
            f"or for trn2 by the official converter, which differ only in query-head order (no weight shows it); "
            f"pass {hw} trn1, or {hw} trn2 {kv_layout} official"
        )
    what = "all K/V heads are equal, so their order tells nothing" if orders else \
        f"the K/V replicas on the {layout.tp} tp ranks fit neither the tiled nor the adjacent order"
    raise (AmbiguousLayout if orders else ConversionError)(
        f"{ckpt.model_dir}: cannot infer trn1/trn2: {what}; pass {hw} trn1, {hw} trn2, "
        f"or {hw} trn2 {kv_layout} official"
    )

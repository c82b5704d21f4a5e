"""Recover the parallel layout of NxD shards that carry no ``ckptconv.json``.

tp and pp come from file names, the attention mode from key names, kvm from the K/V rows per
rank, vpp from which layers each pp rank holds, and trn1 vs trn2 from which ranks hold equal
K/V replicas. Every inference is reported as a note so the user sees what was assumed.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ckptconv.errors import ConversionError
from ckptconv.io.nxd import NxdCheckpoint
from ckptconv.layout import Attention, Hardware, ParallelLayout, Trn2KvLayout, layer_pp_ranks, shard_file
from ckptconv.mapping import EMBED
from ckptconv.model_spec import ModelSpec
from ckptconv.plan import Source

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def infer_layout(ckpt: NxdCheckpoint, spec: ModelSpec, hints: dict[str, object]) -> tuple[ParallelLayout, list[str]]:
    """The layout of ``ckpt``; ``hints`` (flag values the user gave) win over inference."""
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
        if "hw" not in hints and kvm > 1:
            hw, kv_layout, note = _infer_hw(ckpt, spec, layout)
            layout = replace(layout, hw=hw, trn2_kv_layout=kv_layout)
            notes.append(note)
    overrides = {k: v for k, v in hints.items() if v is not None}
    if overrides:
        layout = replace(layout, **overrides)  # type: ignore[arg-type]
        notes.append("given on the command line: " + ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in overrides.items()))
    layout.check_model(spec)
    return layout, notes


def _stored_vocab_rows(ckpt: NxdCheckpoint) -> int:
    """Embedding rows over all tp ranks, as stored (another tool may have padded them, NxDT to 128 x tp)."""
    file = shard_file(tp_rank=0, pp_rank=0)
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
        file = shard_file(tp_rank=0, pp_rank=pp)
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
    file = shard_file(tp_rank=tp_rank, pp_rank=0)
    prefix = _first_layer_prefix(ckpt, file)
    if layout.fuse_qkv:
        n_rows = spec.heads // layout.tp * spec.head_dim
        return ckpt.read_rows(Source(file, prefix + "weight_qkv"), n_rows, n_rows + spec.head_dim)
    return ckpt.read_rows(Source(file, prefix + "weight_k"), 0, spec.head_dim)


def _infer_hw(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout) -> tuple[Hardware, Trn2KvLayout, str]:
    """Adjacent equal replicas mean trn2 (runtime layout); tiled ones mean trn1 (or official trn2)."""
    k0 = _k_rows(ckpt, spec, layout, 0)
    if torch.equal(k0, _k_rows(ckpt, spec, layout, 1)):
        return Hardware.TRN2, Trn2KvLayout.RUNTIME, "trn2 from K/V replicas on adjacent ranks"
    if torch.equal(k0, _k_rows(ckpt, spec, layout, spec.kv_heads)):
        return (
            Hardware.TRN1,
            Trn2KvLayout.RUNTIME,
            "trn1 from tiled K/V replicas (the official trn2 layout looks the same: pass --hw-backend trn2 "
            "--trn2-kv-layout official if that is what wrote these shards)",
        )
    raise ConversionError(
        "cannot infer trn1/trn2: K/V replicas on ranks 0, 1 and "
        f"{spec.kv_heads} all differ; pass --hw-backend (trained replicas may have drifted)"
    )

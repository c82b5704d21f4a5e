"""Which slice of which HF tensor sits where in which NxD shard: the tables of docs/nxd-format.md §3.

This is the one place that knows the GQA head order. Every other module (plans in both
directions, reshard, verify, the training model) asks :func:`q_heads` / :func:`kv_heads` or
:func:`shard_records`.

A shard tensor ("record") is the concatenation along ``dim`` of *segments*, each a range of an
HF tensor along the same dim. Example: on the qkv_linear path with tp 2, kv 2, rank 1 holds
``weight_k = k_proj[8:16]`` (head 1 of head_dim 8), a record with one segment.

    >>> from ckptconv.model_spec import ModelSpec
    >>> from ckptconv.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96,
    ...                  vocab=128, layers=1, tied=False)
    >>> layout = ParallelLayout(tp=4, kvm=2, attention="qkv_linear")
    >>> q_heads(spec, layout, rank=1)
    [4, 5]
    >>> kv_heads(spec, layout, rank=1)
    [1]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ckptconv.errors import ConversionError
from ckptconv.layout import Attention, Hardware, ParallelLayout, Trn2KvLayout, layer_pp_ranks
from ckptconv.model_spec import ModelSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers.{}."

# HF module order inside one decoder layer (docs/nxd-format.md §3, "Key order"): the one ordering rule every key
# order in the project derives from (shards, full state, HF export). Older transformers registered
# ``rotary_emb`` right after ``o_proj``, so its per-layer ``inv_freq`` buffer sits there.
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.rotary_emb.inv_freq",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
OPTIONAL_LAYER_KEYS = frozenset({"self_attn.rotary_emb.inv_freq"})
REPLICATED_LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.rotary_emb.inv_freq")


@dataclass(frozen=True)
class Segment:
    """``hf_key[start:stop]`` along the record's dim."""

    hf_key: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardRecord:
    """One tensor of one shard, described by where its rows (dim 0) or columns (dim 1) come from."""

    key: str
    dim: int
    segments: tuple[Segment, ...]
    column_major: bool = False
    at_end: bool = False  # fused/coalesced keys go after all others (official converter's order)

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


def _head_segments(hf_key: str, heads: Iterable[int], head_dim: int) -> list[Segment]:
    return [Segment(hf_key, h * head_dim, (h + 1) * head_dim) for h in heads]


def _chunk(hf_key: str, total: int, parts: int, index: int) -> Segment:
    size = total // parts
    return Segment(hf_key, index * size, (index + 1) * size)


def merge_segments(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """Join neighbours that are contiguous in the same HF tensor (fewer, larger reads)."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].hf_key == seg.hf_key and out[-1].stop == seg.start:
            out[-1] = Segment(seg.hf_key, out[-1].start, seg.stop)
        else:
            out.append(seg)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Per-layer rules.


def _attention_records(spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
    q, k, v, o = (prefix + "self_attn." + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    tp = layout.tp
    if layout.attention is Attention.SEPARATE:
        yield ShardRecord(q, 0, (_chunk(q, spec.q_rows, tp, rank),))
        yield ShardRecord(k, 0, (_chunk(k, spec.kv_rows, tp, rank),))
        yield ShardRecord(v, 0, (_chunk(v, spec.kv_rows, tp, rank),))
        yield ShardRecord(o, 1, (_chunk(o, spec.q_rows, tp, rank),))
        return
    if layout.attention is Attention.COALESCED:
        parts = tuple(_chunk(key, spec.q_rows, tp, rank) for key in (q, k, v))
        yield ShardRecord(prefix + "self_attn.qkv_proj.weight", 0, parts, at_end=True)
        yield ShardRecord(o, 1, (_chunk(o, spec.q_rows, tp, rank),))
        return
    qh, kvh = q_heads(spec, layout, rank), kv_heads(spec, layout, rank)
    wq = merge_segments(_head_segments(q, qh, spec.head_dim))
    wk = merge_segments(_head_segments(k, kvh, spec.head_dim))
    wv = merge_segments(_head_segments(v, kvh, spec.head_dim))
    base = prefix + "self_attn.qkv_proj."
    if layout.fuse_qkv:
        yield ShardRecord(base + "weight_qkv", 0, wq + wk + wv, at_end=True)
    else:
        yield ShardRecord(base + "weight_q", 0, wq)
        yield ShardRecord(base + "weight_k", 0, wk)
        yield ShardRecord(base + "weight_v", 0, wv)
    # o_proj columns follow the rank's Q heads; the official shard is column-major here.
    yield ShardRecord(o, 1, merge_segments(_head_segments(o, qh, spec.head_dim)), column_major=True)


def _mlp_records(spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
    gate, up, down = (prefix + "mlp." + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj"))
    rows = (_chunk(gate, spec.intermediate, layout.tp, rank), _chunk(up, spec.intermediate, layout.tp, rank))
    yield ShardRecord(prefix + "mlp.gate_up_proj.weight", 0, rows)
    yield ShardRecord(down, 1, (_chunk(down, spec.intermediate, layout.tp, rank),))


def _whole(hf_key: str, length: int) -> ShardRecord:
    return ShardRecord(hf_key, 0, (Segment(hf_key, 0, length),))


# --------------------------------------------------------------------------------------------
# Whole shards.


def hf_key_order(layers: int, *, with_inv_freq: bool) -> list[str]:
    """Every HF key of a Llama with ``layers`` layers in HF module order (``lm_head`` included).

    The one ordering rule (docs/nxd-format.md §3, "Key order"): shard key order, the full-state order and the HF
    export's order are all derived from it, never read from a file (safetensors sorts its keys).

        >>> hf_key_order(1, with_inv_freq=True)[4:6]
        ['model.layers.0.self_attn.o_proj.weight', 'model.layers.0.self_attn.rotary_emb.inv_freq']
    """
    names = [n for n in LAYER_KEYS if with_inv_freq or n not in OPTIONAL_LAYER_KEYS]
    keys = [EMBED]
    for layer in range(layers):
        keys += [LAYER_PREFIX.format(layer) + n for n in names]
    return keys + [FINAL_NORM, LM_HEAD]


def hf_shapes(spec: ModelSpec, *, with_inv_freq: bool) -> dict[str, tuple[int, ...]]:
    """Every HF key of the model with its shape, in HF module order (no ``lm_head`` when tied)."""
    hidden, inter = spec.hidden, spec.intermediate
    per_layer = {
        "self_attn.q_proj.weight": (spec.q_rows, hidden),
        "self_attn.k_proj.weight": (spec.kv_rows, hidden),
        "self_attn.v_proj.weight": (spec.kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, spec.q_rows),
        "self_attn.rotary_emb.inv_freq": (spec.head_dim // 2,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    whole = {EMBED: (spec.vocab, hidden), FINAL_NORM: (hidden,), LM_HEAD: (spec.vocab, hidden)}
    shapes: dict[str, tuple[int, ...]] = {}
    for key in hf_key_order(spec.layers, with_inv_freq=with_inv_freq):
        if key == LM_HEAD and spec.tied:
            continue
        shapes[key] = whole[key] if key in whole else per_layer[key.split(".", 3)[3]]
    return shapes


def stores_lm_head(spec: ModelSpec, nxd_keys: Iterable[str]) -> bool:
    """Whether shards holding ``nxd_keys`` have ``lm_head.weight`` (always, unless tied).

    A tied model's shards come two ways, both valid input (docs/nxd-format.md §4): ours carry a copy of
    the embedding as ``lm_head.weight`` on the last stage, the official converter's carry none.
    """
    return not spec.tied or LM_HEAD in nxd_keys


def shard_records(
    spec: ModelSpec, layout: ParallelLayout, *, tp_rank: int, pp_rank: int, with_inv_freq: bool = False,
    lm_head_copy: bool = True,
) -> list[ShardRecord]:
    """The records of shard (tp_rank, pp_rank) in the official key order.

    Order (docs/nxd-format.md §3, "Key order"): HF module order (:func:`hf_key_order`) filtered to the shard, a
    fused/renamed key in the slot of its first source key, ``at_end`` keys (weight_qkv,
    coalesced qkv_proj) appended in layer order. ``lm_head_copy=False`` describes a tied model's
    shards as the official converter writes them: no ``lm_head.weight`` on the last stage.
    """
    layout.check_model(spec)
    pp_of_layer = layer_pp_ranks(spec.layers, layout)
    records: list[ShardRecord] = []
    vocab = _chunk(EMBED, spec.vocab, layout.tp, tp_rank)
    if pp_rank == 0:
        records.append(ShardRecord(EMBED, 0, (vocab,)))
    for layer, owner in enumerate(pp_of_layer):
        if owner != pp_rank:
            continue
        prefix = LAYER_PREFIX.format(layer)
        records += _attention_records(spec, layout, prefix, tp_rank)
        records += _mlp_records(spec, layout, prefix, tp_rank)
        for name in REPLICATED_LAYER_KEYS:
            if name in OPTIONAL_LAYER_KEYS and not with_inv_freq:
                continue
            length = spec.head_dim // 2 if name.endswith("inv_freq") else spec.hidden
            records.append(_whole(prefix + name, length))
    if pp_rank == layout.pp - 1:
        records.append(_whole(FINAL_NORM, spec.hidden))
        if not spec.tied:
            records.append(ShardRecord(LM_HEAD, 0, (_chunk(LM_HEAD, spec.vocab, layout.tp, tp_rank),)))
        elif lm_head_copy:  # a tied model has no lm_head in HF; our last stage gets its own copy of the embedding
            records.append(ShardRecord(LM_HEAD, 0, (Segment(EMBED, vocab.start, vocab.stop),)))
    return _in_file_order(records, hf_key_order(spec.layers, with_inv_freq=with_inv_freq))


def _in_file_order(records: list[ShardRecord], module_order: list[str]) -> list[ShardRecord]:
    """Each record in the slot of its own HF name, else of its first source key; ``at_end`` ones after."""
    slot = {key: i for i, key in enumerate(module_order)}
    in_slot = sorted((r for r in records if not r.at_end),
                     key=lambda r: slot[r.key] if r.key in slot else slot[r.segments[0].hf_key])
    return in_slot + [r for r in records if r.at_end]


def hf_record_shape(record: ShardRecord, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of a shard record given the shape of (any of) its HF sources."""
    shape = list(hf_shape)
    shape[record.dim] = record.length
    return tuple(shape)


def all_shard_records(
    spec: ModelSpec, layout: ParallelLayout, *, with_inv_freq: bool = False, lm_head_copy: bool = True
) -> dict[tuple[int, int], list[ShardRecord]]:
    """Every shard's records, keyed by (tp_rank, pp_rank), in file order (pp-major)."""
    layout.check_model(spec)
    return {
        (tp, pp): shard_records(spec, layout, tp_rank=tp, pp_rank=pp, with_inv_freq=with_inv_freq,
                                lm_head_copy=lm_head_copy)
        for pp in range(layout.pp)
        for tp in range(layout.tp)
    }


def check_source_shapes(
    spec: ModelSpec, shapes: dict[str, tuple[int, ...]], source: str
) -> bool:
    """Validate a source's keys and shapes against the config; return whether it has inv_freq."""
    with_inv_freq = any(k.endswith("rotary_emb.inv_freq") for k in shapes)
    expected = hf_shapes(spec, with_inv_freq=with_inv_freq)
    for key, shape in expected.items():
        if key not in shapes:
            raise ConversionError(f"{source}: missing tensor {key!r} (expected shape {list(shape)})")
        if tuple(shapes[key]) != shape:
            raise ConversionError(
                f"{source}: tensor {key!r} has shape {list(shapes[key])}, config.json implies {list(shape)}"
            )
    unknown = [k for k in shapes if k not in expected and not (spec.tied and k == LM_HEAD)]
    if unknown:
        raise ConversionError(
            f"{source}: {len(unknown)} tensor(s) not in a Llama model of this config, e.g. {unknown[0]!r}"
        )
    return with_inv_freq

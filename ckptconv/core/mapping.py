"""Which slice of which HF tensor sits where in which NxD shard: the tables of docs/nxd-format.md §3.

The decoder layer's parameters come from the model's family (:mod:`ckptconv.core.families`: one rule object per
kind of parameter); this module adds the model-level tensors (embedding, final norm, lm_head), orders a
shard's records and checks a source against the family's shapes. The head order lives in
:mod:`ckptconv.core.heads` (re-exported here).

    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96,
    ...                  vocab=128, layers=1, tied=False)
    >>> [r.key for r in shard_records(spec, ParallelLayout(tp=2), tp_rank=0, pp_rank=0)][:3]
    ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckptconv.core.families import LLAMA, Family
from ckptconv.core.heads import Segment, ShardRecord, kv_heads, merge_segments, q_heads, vocab_segments
from ckptconv.core.layout import ParallelLayout, layer_pp_ranks
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec

__all__ = ["EMBED", "FINAL_NORM", "LM_HEAD", "Segment", "ShardRecord", "kv_heads", "merge_segments", "q_heads"]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers.{}."


def _whole(hf_key: str, length: int) -> ShardRecord:
    return ShardRecord(hf_key, 0, (Segment(hf_key, 0, length),))


# --------------------------------------------------------------------------------------------
# Whole shards.


def hf_key_order(layers: int, *, with_inv_freq: bool, family: Family = LLAMA,
                 config: dict[str, Any] | None = None) -> list[str]:
    """Every HF key of a ``family`` model with ``layers`` layers in HF module order (``lm_head`` included).

    The one ordering rule (docs/nxd-format.md §3, "Key order"): shard key order, the full-state order and the HF
    export's order are all derived from it, never read from a file (safetensors sorts its keys).

        >>> hf_key_order(1, with_inv_freq=True)[4:6]
        ['model.layers.0.self_attn.o_proj.weight', 'model.layers.0.self_attn.rotary_emb.inv_freq']
    """
    optional = family.optional_layer_keys
    keys = [EMBED]
    for layer in range(layers):
        names = family.layer_keys_of(config, layer) if family.moe is not None and config else family.layer_keys
        keys += [LAYER_PREFIX.format(layer) + n for n in names if with_inv_freq or n not in optional]
    return keys + [FINAL_NORM, LM_HEAD]


def key_order(spec: ModelSpec, *, with_inv_freq: bool) -> list[str]:
    """:func:`hf_key_order` of ``spec``'s model (its sparse and dense layers told apart by its config), its MTP layers
    (:attr:`ModelSpec.mtp_layers`) after the decoder layers: each a decoder layer, then its own tensors."""
    keys = hf_key_order(spec.layers, with_inv_freq=with_inv_freq, family=spec.family, config=spec.config)
    family, mtp = spec.family, []
    for layer in range(spec.layers, spec.layers + spec.mtp_layers):
        names = (*family.layer_keys_of(spec.config, layer), *family.mtp_keys())
        mtp += [LAYER_PREFIX.format(layer) + n for n in names if n not in family.optional_layer_keys]
    return keys[:-2] + mtp + keys[-2:]


def hf_shapes(spec: ModelSpec, *, with_inv_freq: bool) -> dict[str, tuple[int, ...]]:
    """Every HF key of the model with its shape, in HF module order (no ``lm_head`` when tied)."""
    per_layer = spec.family.layer_shapes(spec)
    whole = {EMBED: (spec.vocab, spec.hidden), FINAL_NORM: (spec.hidden,), LM_HEAD: (spec.vocab, spec.hidden)}
    shapes: dict[str, tuple[int, ...]] = {}
    for key in key_order(spec, with_inv_freq=with_inv_freq):
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
    spec: ModelSpec, layout: ParallelLayout, *, tp_rank: int, pp_rank: int, lm_head_copy: bool = True,
    ep_rank: int = 0,
) -> list[ShardRecord]:
    """The records of shard (tp_rank, pp_rank) of expert-parallel rank ``ep_rank`` in the official key order.

    An ep rank > 0 holds only its experts (NxD's converter and loader keep every other tensor in ep rank 0's files).

    Order (docs/nxd-format.md §3, "Key order"): HF module order (:func:`hf_key_order`) filtered to the shard, a
    fused/renamed key in the slot of its first source key, ``at_end`` keys (weight_qkv,
    coalesced qkv_proj) appended in layer order. ``lm_head_copy=False`` describes a tied model's
    shards as the official converter writes them: no ``lm_head.weight`` on the last stage.
    """
    layout.check_model(spec)
    pp_of_layer = layer_pp_ranks(spec.layers, layout)
    records: list[ShardRecord] = []
    rows = layout.vocab_rows(spec)
    vocab = vocab_segments(EMBED, spec.vocab, rows, layout.tp, tp_rank)
    if pp_rank == 0 and ep_rank == 0:
        records.append(ShardRecord(EMBED, 0, vocab))
    for layer, owner in enumerate(pp_of_layer):
        if owner == pp_rank:
            records += _layer_records(spec, layout, layer, tp_rank, ep_rank)
    if pp_rank == layout.pp - 1 and ep_rank == 0:
        records.append(_whole(FINAL_NORM, spec.hidden))
        if not spec.tied:
            records.append(ShardRecord(LM_HEAD, 0, vocab_segments(LM_HEAD, spec.vocab, rows, layout.tp, tp_rank)))
        elif lm_head_copy:  # a tied model has no lm_head in HF; our last stage gets its own copy of the embedding
            records.append(ShardRecord(LM_HEAD, 0, vocab))
    return _in_file_order(records, key_order(spec, with_inv_freq=layout.with_inv_freq))


def _layer_records(spec: ModelSpec, layout: ParallelLayout, layer: int, tp_rank: int, ep_rank: int) -> list[ShardRecord]:
    optional = spec.family.optional_layer_keys
    prefix = LAYER_PREFIX.format(layer)
    out: list[ShardRecord] = []
    for rule in spec.family.rules_for(spec.config, layer):
        if _is_expert(rule):
            out += rule.records(spec, layout, prefix, tp_rank, ep_rank=ep_rank)  # type: ignore[call-arg]
        elif ep_rank == 0 and (layout.with_inv_freq or not (rule.hf_names and set(rule.hf_names) <= optional)):
            out += rule.records(spec, layout, prefix, tp_rank)
    return out


def _is_expert(rule: object) -> bool:
    """Whether a family rule's tensors are expert tensors: in every ep rank's files, each its own experts."""
    return bool(getattr(rule, "expert", False))


def expert_keys(spec: ModelSpec) -> frozenset[str]:
    """The NxD keys of ``spec``'s expert tensors (stacked experts, split over ep); empty for a dense model.

    Every other key is held by ep rank 0's files only, and its optimizer state is ZeRO-1-sharded over all dp ranks,
    an expert key's over the ep rank's expert-data-parallel group (docs/nxd-optimizer-format.md).
    """
    if spec.family.moe is None:
        return frozenset()
    one = ParallelLayout()
    return frozenset(r.key for layer in range(spec.layers) for rule in spec.family.rules_for(spec.config, layer)
                     if _is_expert(rule)
                     for r in rule.records(spec, one, LAYER_PREFIX.format(layer), 0))


def _in_file_order(records: list[ShardRecord], module_order: list[str], *, at_end: bool = True) -> list[ShardRecord]:
    """Each record in the slot of its own HF name, else of its first source key; ``at_end`` ones after
    (``at_end`` False: those in their slot too)."""
    slot = {key: i for i, key in enumerate(module_order)}
    in_slot = sorted((r for r in records if not (at_end and r.at_end)),
                     key=lambda r: slot[r.key] if r.key in slot else slot[r.segments[0].hf_key])
    return in_slot + [r for r in records if at_end and r.at_end]


def live_module_order(spec: ModelSpec, layout: ParallelLayout, *, tp_rank: int, pp_rank: int) -> list[str]:
    """The keys of shard (tp_rank, pp_rank) in the order of a live NxD model's parameters (what NxD's own
    save writes, and what its optimizer indices follow): every key in the slot of its first HF source key,
    a fused ``weight_qkv`` included (the official converter appends those at the end instead)."""
    records = shard_records(spec, layout, tp_rank=tp_rank, pp_rank=pp_rank)
    order = key_order(spec, with_inv_freq=layout.with_inv_freq)
    return [r.key for r in _in_file_order(records, order, at_end=False)]


def hf_record_shape(record: ShardRecord, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of a shard record given the shape of (any of) its HF sources."""
    shape = list(hf_shape)
    shape[record.dim] = record.length // max(record.slabs, 1)
    if record.transposed:
        shape.reverse()
    return (record.slabs, *shape) if record.slabs else tuple(shape)


def all_shard_records(
    spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool = True
) -> dict[tuple[int, int], list[ShardRecord]]:
    """Every shard's records, keyed by (tp_rank, pp_rank), in file order (pp-major): :func:`all_ep_shard_records`
    without its ep index, for a layout without expert parallelism (a (tp, pp) key cannot name an ep rank)."""
    layout.check_model(spec)  # an invalid layout is said first, as before
    if layout.ep > 1:
        raise ConversionError(f"this command does not handle expert parallelism yet (ep {layout.ep}); ep 1 works")
    return {(tp, pp): records for (_, tp, pp), records in
            all_ep_shard_records(spec, layout, lm_head_copy=lm_head_copy).items()}


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
            f"{source}: {len(unknown)} tensor(s) not in a {spec.family.name} model of this config, e.g. {unknown[0]!r}"
        )
    return with_inv_freq


def all_ep_shard_records(
    spec: ModelSpec, layout: ParallelLayout, *, lm_head_copy: bool = True
) -> dict[tuple[int, int, int], list[ShardRecord]]:
    """Every shard's records keyed by (ep_rank, tp_rank, pp_rank), in NxD's rank order (pp, then ep, then tp): the
    one keying of a layout's shards (ep rank 0 alone without expert parallelism)."""
    layout.check_model(spec)
    return {
        (ep, tp, pp): shard_records(spec, layout, tp_rank=tp, pp_rank=pp, ep_rank=ep, lm_head_copy=lm_head_copy)
        for pp in range(layout.pp)
        for ep in range(layout.ep)
        for tp in range(layout.tp)
    }

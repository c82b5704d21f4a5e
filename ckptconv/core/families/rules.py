"""Per-parameter rule objects: how one kind of decoder-layer parameter is split over tp ranks.

A family (:mod:`ckptconv.core.families`) lists one rule per kind of parameter in HF module order; the rules
turn (spec, layout, rank) into the shard records of :mod:`ckptconv.core.mapping`, which holds the head order
they all ask. Names are relative to ``model.layers.N.``. Each rule's ``hf_names`` are its HF tensors in HF
module order, and ``shapes`` gives their full shapes: the HF key order and the source checks derive from them.

    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=1,
    ...                  tied=False)
    >>> rule = QkvRule(bias=True)
    >>> [r.key for r in rule.records(spec, ParallelLayout(tp=2, fuse_qkv=True, attention="qkv_linear"), "", 0)]
    ['self_attn.qkv_proj.weight_qkv', 'self_attn.qkv_proj.bias_qkv']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptconv.core.heads import Segment, ShardRecord, chunk, head_segments, kv_heads, merge_segments, q_heads
from ckptconv.core.layout import Attention, ParallelLayout

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec

Size = Callable[["ModelSpec"], int]
Shapes = dict[str, tuple[int, ...]]


def hidden(spec: ModelSpec) -> int:
    return spec.hidden


def head_dim(spec: ModelSpec) -> int:
    return spec.head_dim


def half_head_dim(spec: ModelSpec) -> int:
    return spec.head_dim // 2


def intermediate(spec: ModelSpec) -> int:
    return spec.intermediate


@dataclass(frozen=True)
class QkvRule:
    """q/k/v projections (and, with ``bias``, their biases, split exactly like their weight rows).

    Separate: ``q_proj``/``k_proj``/``v_proj`` chunks. Coalesced: ``qkv_proj.weight`` (``.bias``) of the
    three chunks. qkv_linear: ``qkv_proj.weight_q/_k/_v`` (``bias_q/_k/_v``) by head, K/V replicas included,
    or ``weight_qkv`` (``bias_qkv``) fused; fused and coalesced keys go after all others.
    """

    bias: bool = False
    parts: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")

    @property
    def hf_names(self) -> tuple[str, ...]:
        kinds = ("weight", "bias") if self.bias else ("weight",)
        return tuple(f"self_attn.{p}.{kind}" for p in self.parts for kind in kinds)

    def shapes(self, spec: ModelSpec) -> Shapes:
        rows = (spec.q_rows, spec.kv_rows, spec.kv_rows)
        out: Shapes = {}
        for part, n in zip(self.parts, rows, strict=True):
            out[f"self_attn.{part}.weight"] = (n, spec.hidden)
            if self.bias:
                out[f"self_attn.{part}.bias"] = (n,)
        return out

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        yield from self._records(spec, layout, prefix, rank, "weight")
        if self.bias:
            yield from self._records(spec, layout, prefix, rank, "bias")

    def _records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int,
                 kind: str) -> Iterator[ShardRecord]:
        q, k, v = (f"{prefix}self_attn.{p}.{kind}" for p in self.parts)
        tp = layout.tp
        if layout.attention is Attention.SEPARATE:
            yield ShardRecord(q, 0, (chunk(q, spec.q_rows, tp, rank),))
            yield ShardRecord(k, 0, (chunk(k, spec.kv_rows, tp, rank),))
            yield ShardRecord(v, 0, (chunk(v, spec.kv_rows, tp, rank),))
            return
        if layout.attention is Attention.COALESCED:
            parts = tuple(chunk(key, spec.q_rows, tp, rank) for key in (q, k, v))
            yield ShardRecord(f"{prefix}self_attn.qkv_proj.{kind}", 0, parts, at_end=True)
            return
        qh, kvh = q_heads(spec, layout, rank), kv_heads(spec, layout, rank)
        sq = merge_segments(head_segments(q, qh, spec.head_dim))
        sk = merge_segments(head_segments(k, kvh, spec.head_dim))
        sv = merge_segments(head_segments(v, kvh, spec.head_dim))
        base = f"{prefix}self_attn.qkv_proj.{kind}_"
        if layout.fuse_qkv:
            yield ShardRecord(base + "qkv", 0, sq + sk + sv, at_end=True)
        else:
            yield ShardRecord(base + "q", 0, sq)
            yield ShardRecord(base + "k", 0, sk)
            yield ShardRecord(base + "v", 0, sv)


@dataclass(frozen=True)
class OutProjRule:
    """o_proj: row-parallel (split along its input columns), the columns following the rank's Q heads.

    On the qkv_linear path the official shard stores it column-major.
    """

    name: str = "self_attn.o_proj.weight"

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.name,)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.name: (spec.hidden, spec.q_rows)}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        key = prefix + self.name
        if layout.attention is not Attention.QKV_LINEAR:
            yield ShardRecord(key, 1, (chunk(key, spec.q_rows, layout.tp, rank),))
            return
        columns = merge_segments(head_segments(key, q_heads(spec, layout, rank), spec.head_dim))
        yield ShardRecord(key, 1, columns, column_major=True)


@dataclass(frozen=True)
class GateUpRule:
    """gate and up projections fused into one column-parallel ``fused`` tensor: this rank's gate rows, then its up rows."""

    gate: str = "mlp.gate_proj.weight"
    up: str = "mlp.up_proj.weight"
    fused: str = "mlp.gate_up_proj.weight"

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.gate: (spec.intermediate, spec.hidden), self.up: (spec.intermediate, spec.hidden)}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        gate, up = prefix + self.gate, prefix + self.up
        rows = (chunk(gate, spec.intermediate, layout.tp, rank), chunk(up, spec.intermediate, layout.tp, rank))
        yield ShardRecord(prefix + self.fused, 0, rows)


@dataclass(frozen=True)
class RowRule:
    """A row-parallel linear layer ``[out, in]``: each rank holds a block of ``in`` columns."""

    name: str
    out_size: Size
    in_size: Size

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.name,)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.name: (self.out_size(spec), self.in_size(spec))}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        key = prefix + self.name
        yield ShardRecord(key, 1, (chunk(key, self.in_size(spec), layout.tp, rank),))


@dataclass(frozen=True)
class ReplicatedRule:
    """A 1-D tensor every tp rank holds whole (norm weights, per-head q/k norms, ``inv_freq``).

    ``optional``: a source may lack it (older transformers stored ``rotary_emb.inv_freq``); present in a
    source, it is carried through.
    """

    name: str
    size: Size
    optional: bool = False

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.name,)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.name: (self.size(spec),)}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        key = prefix + self.name
        yield ShardRecord(key, 0, (Segment(key, 0, self.size(spec)),))

"""Mixture-of-experts rules: the router and the experts in NxD's expert layout (docs/nxd-format.md, "MoE layers").

NxD (``neuronx_distributed.modules.moe``) holds a layer's experts stacked with the input dimension first, the
transpose of HF's per-expert ``[out, in]``: ``mlp.expert_mlps.mlp_op.gate_up_proj.weight`` ``[E/ep, H, 2I/tp]``
(column-parallel with stride 2: each tp rank's last dim is ``[gate_r | up_r]``) and
``mlp.expert_mlps.mlp_op.down_proj.weight`` ``[E/ep, I/tp, H]`` (row-parallel); ep rank ``r`` holds the contiguous
experts ``[r E/ep, (r+1) E/ep)``. The router ``mlp.router.linear_router.weight`` ``[E, H]`` is whole on every rank.

    >>> from ckptconv.core.model_spec import ModelSpec
    >>> from ckptconv.core.layout import ParallelLayout
    >>> spec = ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2,
    ...     "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 16,
    ...     "num_hidden_layers": 1})
    >>> rule = ExpertsRule(MIXTRAL_NAMES)
    >>> [(r.key.split(".")[-2], r.slabs, r.transposed, r.length) for r in
    ...  rule.records(spec, ParallelLayout(tp=2, ep=2), "", 1, ep_rank=1)]
    [('gate_up_proj', 2, True, 24), ('down_proj', 2, True, 12)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.heads import Segment, ShardRecord, chunk

if TYPE_CHECKING:
    from ckptconv.core.families.rules import Shapes
    from ckptconv.core.layout import ParallelLayout
    from ckptconv.core.model_spec import ModelSpec

NXD_ROUTER = "mlp.router.linear_router.weight"
NXD_GATE_UP = "mlp.expert_mlps.mlp_op.gate_up_proj.weight"
NXD_DOWN = "mlp.expert_mlps.mlp_op.down_proj.weight"
# transformers' in-memory (fused) names, what newer hub checkpoints store: gate_up [E, 2I, H], down [E, H, I]
FUSED_ROUTER = "mlp.gate.weight"
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"


@dataclass(frozen=True)
class ExpertNames:
    """A family's HF names of one MoE layer (relative to ``model.layers.N.``), per expert ``{e}``."""

    router: str
    gate: str
    up: str
    down: str

    def of(self, e: int) -> tuple[str, str, str]:
        return self.gate.format(e=e), self.up.format(e=e), self.down.format(e=e)

    def per_expert_order(self, experts: int) -> tuple[str, ...]:
        """The per-expert names in module order: each expert's gate, up and down (so a shard holds ``gate_up_proj``
        before ``down_proj``, as NxD's ``Experts`` module registers them)."""
        return tuple(name for e in range(experts) for name in self.of(e))


MIXTRAL_NAMES = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                            "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")
QWEN3_MOE_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                              "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")


def _always_sparse(config: dict[str, Any], layer: int) -> bool:
    return True


@dataclass(frozen=True)
class MoeConfig:
    """Where a family's config states its experts, and which layers are sparse.

    ``norm_topk``: whether the top-k router weights are renormalized to sum to 1 (Mixtral always; Qwen3-MoE when
    ``norm_topk_prob``), as the family's transformers class computes them. ``cast_topk``: whether the router casts
    the (fp32) top-k weights back to the model's dtype (``Qwen3MoeTopKRouter`` does, ``MixtralTopKRouter`` not).
    """

    experts_key: str
    intermediate_key: str
    names: ExpertNames
    sparse: Callable[[dict[str, Any], int], bool] = _always_sparse
    norm_topk: Callable[[dict[str, Any]], bool] = lambda config: True
    cast_topk: bool = False

    aliases: tuple[str, ...] = ()  # other keys a config may state the experts under (transformers 5 writes
    # Qwen3-MoE's num_experts as num_local_experts)

    def experts_key_in(self, config: dict[str, Any]) -> str:
        return next((k for k in (self.experts_key, *self.aliases) if k in config), self.experts_key)

    def experts(self, config: dict[str, Any]) -> int:
        value = config.get(self.experts_key_in(config))
        return value if type(value) is int and value > 0 else 0

    def top_k(self, config: dict[str, Any]) -> int:
        return int(config.get("num_experts_per_tok") or 0)


@dataclass(frozen=True)
class RouterRule:
    """The router ``[E, H]``: whole on every tp and ep rank, under NxD's name."""

    names: ExpertNames
    nxd: str = NXD_ROUTER

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.names.router,)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.names.router: (spec.experts, spec.hidden)}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        yield ShardRecord(prefix + self.nxd, 0, (Segment(prefix + self.names.router, 0, spec.experts),))


@dataclass(frozen=True)
class ExpertsRule:
    """The experts of one layer, stacked and transposed into NxD's two tensors, split over ep (experts) and tp (I).

    ``expert``: only this rule's tensors live in the files of ep ranks > 0.
    """

    names: ExpertNames
    gate_up: str = NXD_GATE_UP
    down: str = NXD_DOWN
    expert: bool = True

    def hf_names_of(self, experts: int) -> tuple[str, ...]:
        return self.names.per_expert_order(experts)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return ()  # per model: see hf_names_of (the count of experts is in the config)

    def shapes(self, spec: ModelSpec) -> Shapes:
        out: Shapes = {}
        h, i = spec.hidden, spec.expert_intermediate
        for e in range(spec.experts):
            gate, up, down = self.names.of(e)
            out.update({gate: (i, h), up: (i, h), down: (h, i)})
        return out

    def local_experts(self, spec: ModelSpec, layout: ParallelLayout, ep_rank: int) -> range:
        per = spec.experts // layout.ep
        return range(ep_rank * per, (ep_rank + 1) * per)

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int,
                ep_rank: int = 0) -> Iterator[ShardRecord]:
        i, tp = spec.expert_intermediate, layout.tp
        local = self.local_experts(spec, layout, ep_rank)
        gate_up: list[Segment] = []
        down: list[Segment] = []
        for e in local:
            gate, up, dn = (prefix + n for n in self.names.of(e))
            gate_up += [chunk(gate, i, tp, rank), chunk(up, i, tp, rank)]  # stride 2: [gate_r | up_r]
            down.append(chunk(dn, i, tp, rank))  # columns of [H, I]
        yield ShardRecord(prefix + self.gate_up, 0, tuple(gate_up), slabs=len(local), transposed=True)
        yield ShardRecord(prefix + self.down, 1, tuple(down), slabs=len(local), transposed=True)


@dataclass(frozen=True)
class View:
    """A per-expert HF tensor read from a fused one: rows ``start:stop`` of expert ``expert`` of ``key`` (``expert``
    None: the whole of ``key``, a router under transformers' in-memory name)."""

    key: str
    expert: int | None
    start: int = 0
    stop: int = 0


def fused_views(spec: ModelSpec, present: set[str]) -> dict[str, View]:
    """The per-expert names of every sparse layer stored fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``, what transformers 5 holds in memory and newer hub models store), as
    views of the fused tensors; empty for a per-expert checkpoint."""
    moe = spec.family.moe
    views: dict[str, View] = {}
    if moe is None:
        return views
    names, i, h = moe.names, spec.expert_intermediate, spec.hidden
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}."
        if not spec.sparse(layer) or prefix + FUSED_GATE_UP not in present:
            continue
        if prefix + names.router not in present and prefix + FUSED_ROUTER in present:
            views[prefix + names.router] = View(prefix + FUSED_ROUTER, None)
        for e in range(spec.experts):
            gate, up, down = (prefix + n for n in names.of(e))
            views[gate] = View(prefix + FUSED_GATE_UP, e, 0, i)
            views[up] = View(prefix + FUSED_GATE_UP, e, i, 2 * i)
            views[down] = View(prefix + FUSED_DOWN, e, 0, h)
    return views

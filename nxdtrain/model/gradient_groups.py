"""Which gradients a rank sums with whom: the :class:`nxdtrain.parallel.grads.GradPlan` of one stage in a run's
process groups (dp x cp, K/V replicas, sequence-parallel norms, the tied embedding, MoE's expert groups)."""

from __future__ import annotations

from typing import Any

from ckptconv.core import EMBED, LM_HEAD, ModelSpec, ParallelLayout
from nxdtrain.model.stage import LlamaStage, rank_heads
from nxdtrain.parallel.dist import Mesh
from nxdtrain.parallel.grads import GradPlan


def grad_plan(model: LlamaStage, mesh: Mesh, spec: ModelSpec, layout: ParallelLayout,
              experts: tuple[Any, Any] | None = None) -> GradPlan:
    """Who sums which gradients with whom (see nxdtrain.parallel.grads) for ``model``, this rank's stage of the
    run's ``layout``; ``experts``: MoE's (ep, expert-data-parallel) groups. Collective: every rank calls it."""
    tp_rank = mesh.coords.tp
    # Gradients are summed over dp x cp: the cp ranks of a replica each hold their chunks' share.
    out = GradPlan(dp_group=mesh.dpcp_group, mp_group=mesh.mp_group)
    names = {id(p): n for n, p in model.named_parameters()}
    if model.tp.sequence_parallel and mesh.tp_group is not None:  # norm weights saw only their sequence slice
        out.seq_group, out.seq_names = mesh.tp_group, tuple(model.tp_replicated())
    elif model.tp_partial() and mesh.tp_group is not None:  # per-head q/k norms saw only this rank's heads
        out.seq_group, out.seq_names = mesh.tp_group, tuple(model.tp_partial())
    if tp_rank != 0:
        out.uncounted.update({name: [] for name in model.tp_replicated()})
    # Ranks holding the same K/V heads form a replica group (kv_size_multiplier > 1).
    replicas: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.tp):
        replicas.setdefault(rank_heads(spec, layout, rank).kv, []).append(rank)
    partition = list(replicas.values())
    if any(len(part) > 1 for part in partition):
        out.kv_group = mesh.tp_subgroups(partition)
        out.kv_rows = [(names[id(p)], rows) for attn in model.attention_layers() for p, rows in attn.kv_rows()]
        if next(part for part in partition if tp_rank in part)[0] != tp_rank:
            for name, rows in out.kv_rows:
                out.uncounted.setdefault(name, []).append(rows)
    if experts is not None:  # MoE: each ep rank's experts are summed over the ranks holding the same ones
        out.expert_names, (out.ep_group, out.edp_group) = tuple(model.expert_params()), experts
    if spec.tied:
        out.tied_group = mesh.first_last_stage_group()
        out.tied_names = tuple(n for n in (EMBED, LM_HEAD) if n in names.values())
        if LM_HEAD in out.tied_names:
            out.uncounted[LM_HEAD] = []
    return out

"""verify's sparse MLP: a mixture-of-experts layer computed rank by rank from NxD's expert shards.

Each (ep rank, tp rank) holds ``gate_up_proj`` ``[E/ep, H, 2I/tp]`` (each slab ``[gate_r | up_r]``, input dim first)
and ``down_proj`` ``[E/ep, I/tp, H]`` of its experts (docs/nxd-format.md, "MoE layers"); ep rank 0 holds the router
``[E, H]``. Tokens are routed with the rank's router exactly as the family's transformers class routes them
(:func:`ckptconv.core.reference.route`), each rank's experts give a partial output on its ``I/tp`` block, and the sum
over ep and tp ranks must equal the dense HF block. Each expert is also computed alone on every token against the HF
expert it should be, so a swapped expert is named with the expert it holds. A stack stored untransposed (the official
converter's defect) has the wrong shape when H != I and is refused, named, when the shards are opened
(:func:`ckptconv.sources.nxd.open_nxd`).

    >>> _expert_notes({0: 1, 1: 0, 2: 2, 3: -1}, " on ep rank 1 tp rank 0")  # what each local expert's output matched
    ['experts 0 and 1 swapped on ep rank 1 tp rank 0', 'expert 3 on ep rank 1 tp rank 0 differs (its output matches no expert: gate/up/down blocks wrong)']

:func:`expert_notes` is that naming for any set of experts (verify of a DCP calls it with every expert of a layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP, NXD_ROUTER
from ckptconv.core.reference import Expert, mlp, route, routed_experts, sparse_mlp

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec

Close = Callable[[torch.Tensor, torch.Tensor], bool]


def hf_experts(spec: ModelSpec, hf_w: dict[str, torch.Tensor]) -> dict[int, Expert]:
    """Every expert of one layer from its HF weights (names relative to ``model.layers.N.``)."""
    names = spec.family.moe.names  # type: ignore[union-attr]  # a sparse layer's family has one
    out: dict[int, Expert] = {}
    for e in range(spec.experts):
        gate, up, down = names.of(e)
        out[e] = (hf_w[gate], hf_w[up], hf_w[down])
    return out


def dense_sparse_mlp(spec: ModelSpec, hf_w: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dense HF block of a sparse layer as a function of its input (for ``reference.dense_layer``)."""
    moe = spec.family.moe
    assert moe is not None
    router, experts = hf_w[moe.names.router], hf_experts(spec, hf_w)
    return lambda h: sparse_mlp(h, router, experts, spec.top_k, normalize=moe.norm_topk(spec.config),
                                cast_back=moe.cast_topk)


def check_sparse_mlp(shards: Any, layer: int, h2: torch.Tensor, h2_of_tp: list[torch.Tensor],
                     hf_w: dict[str, torch.Tensor], close: Close) -> tuple[torch.Tensor, list[int], str]:
    """The sum over ep and tp ranks of each rank's routed-expert output of layer ``layer``, the tp ranks whose own
    pieces disagree, and what disagrees (router, shapes, experts by name). ``h2``: the dense MLP input; ``h2_of_tp``:
    each tp rank's (normed with its own norm weight). ``shards``: verify's ``_Shards``."""
    spec, layout = shards.spec, shards.layout
    moe = spec.family.moe
    i_block = spec.expert_intermediate // layout.tp
    per = spec.experts // layout.ep
    hf = hf_experts(spec, hf_w)
    prefix, pp = f"model.layers.{layer}.", shards.pp_of_layer[layer]
    total = torch.zeros_like(h2).reshape(-1, spec.hidden)
    flat = h2.reshape(-1, spec.hidden)
    bad: set[int] = set()
    notes: list[str] = []
    for tp in range(layout.tp):
        h = h2_of_tp[tp].reshape(-1, spec.hidden)
        router = shards.tensor(shards.file(tp, pp), prefix + NXD_ROUTER)
        if not close(router, hf_w[moe.names.router]):
            bad.add(tp)
            notes.append(f"router differs on tp rank {tp}")
        weights, indices = route(h, router, spec.top_k, normalize=moe.norm_topk(spec.config), cast_back=moe.cast_topk)
        rows = slice(tp * i_block, (tp + 1) * i_block)
        expected = {e: mlp(flat, g[rows], u[rows], d[:, rows]) for e, (g, u, d) in hf.items()}
        for ep in range(layout.ep):
            file = shards.ckpt.file_of(tp_rank=tp, pp_rank=pp, ep_rank=ep)
            stacks = {name: shards.tensor(file, prefix + key)
                      for name, key in (("gate_up_proj", NXD_GATE_UP), ("down_proj", NXD_DOWN))}
            local = _rank_experts(stacks, range(ep * per, (ep + 1) * per))
            total += routed_experts(h, weights, indices, local)
            misplaced = expert_notes(flat, local, expected, close, f" on ep rank {ep} tp rank {tp}")
            if misplaced:
                bad.add(tp)
                notes += misplaced
    return total.view_as(h2), sorted(bad), "; ".join(notes)


def _rank_experts(stacks: dict[str, torch.Tensor], experts: range) -> dict[int, Expert]:
    """A rank's experts in HF orientation: slab ``j`` of ``gate_up_proj`` ``[H, 2I/tp]`` is ``[gate | up]``
    transposed, of ``down_proj`` ``[I/tp, H]`` the transpose of the expert's ``down`` columns."""
    out: dict[int, Expert] = {}
    for j, e in enumerate(experts):
        gate, up = stacks["gate_up_proj"][j].t().chunk(2)
        out[e] = (gate, up, stacks["down_proj"][j].t())
    return out


def expert_notes(flat: torch.Tensor, experts: dict[int, Expert], expected: dict[int, torch.Tensor], close: Close,
                 where: str = "") -> list[str]:
    """Each of ``experts`` computed alone on tokens ``flat``, against ``expected`` (expert -> the HF expert's output
    on them): what is wrong, naming the experts (swapped, holding another's weights, matching none); ``where``: the
    place said after an expert (" on ep rank 1 tp rank 0")."""
    held = {e: _which(mlp(flat, *w), expected, e, close) for e, w in experts.items()}
    return _expert_notes(held, where)


def _which(actual: torch.Tensor, expected: dict[int, torch.Tensor], claimed: int, close: Close) -> int:
    """The expert whose output ``actual`` is: ``claimed`` when it matches, another expert's index, or -1."""
    if close(actual, expected[claimed]):
        return claimed
    return next((e for e, value in expected.items() if close(actual, value)), -1)


def _expert_notes(held: dict[int, int], where: str) -> list[str]:
    notes, done = [], set()
    for e, other in sorted(held.items()):
        if e == other or e in done:
            continue
        if other >= 0 and held.get(other) == e:
            notes.append(f"experts {e} and {other} swapped{where}")
            done.add(other)
        elif other >= 0:
            notes.append(f"expert {e}{where} holds expert {other}'s weights")
        else:
            notes.append(f"expert {e}{where} differs (its output matches no expert: gate/up/down blocks wrong)")
    return notes

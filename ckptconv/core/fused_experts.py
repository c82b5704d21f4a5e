"""HF output with fused experts: each sparse layer's per-expert tensors stacked into transformers 5's in-memory form.

``--hf-experts fused`` (to-hf): ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (expert ``e``'s gate rows,
then its up rows), ``model.layers.N.mlp.experts.down_proj`` ``[E, H, I]`` and the router under ``mlp.gate.weight``
(Mixtral's ``block_sparse_moe.gate.weight`` renamed), what ``MixtralExperts`` / ``Qwen3MoeExperts`` hold and newer hub
checkpoints store. Each fused tensor is the per-expert plan tensors' pieces, one slab per expert, so its bytes are the
per-expert output's stacked.

    >>> HF_EXPERTS
    ('per-expert', 'fused')
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ckptconv.core.families.moe import FUSED_DOWN, FUSED_GATE_UP, FUSED_ROUTER
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec
    from ckptconv.core.plan import OutTensor

HF_EXPERTS = ("per-expert", "fused")


def check_hf_experts(value: str, spec: ModelSpec) -> bool:
    """Whether ``value`` (``--hf-experts``) asks for fused experts; a ValueError names the choices, a
    ConversionError a dense model asked for fused experts."""
    if value not in HF_EXPERTS:
        raise ValueError(f"--hf-experts must be one of {', '.join(HF_EXPERTS)}, got {value!r}")
    if value == "fused" and not spec.experts:
        raise ConversionError(f"--hf-experts fused: {spec.family.name} ({spec.family.model_type}) has no experts")
    return value == "fused"


def fuse_experts(spec: ModelSpec, tensors: list[OutTensor]) -> list[OutTensor]:
    """``tensors`` (the per-expert HF plan, in HF order) with every sparse layer's experts stacked: the fused
    ``gate_up_proj`` in the slot of the layer's first expert tensor, ``down_proj`` after it, the router renamed."""
    moe = spec.family.moe
    assert moe is not None, "fuse_experts of a dense model"
    by_key = {t.key: t for t in tensors}
    replaced: dict[str, list[OutTensor]] = {}
    dropped: set[str] = set()
    for layer in range(spec.layers):
        if not spec.sparse(layer):
            continue
        prefix = f"model.layers.{layer}."
        names = [tuple(prefix + n for n in moe.names.of(e)) for e in range(spec.experts)]
        gate_up = [p for gate, up, _ in names for key in (gate, up) for p in by_key[key].pieces]
        down = [p for _, _, dn in names for p in by_key[dn].pieces]
        first, first_down = by_key[names[0][0]], by_key[names[0][2]]
        i, h = first.shape
        fused = [replace(first, key=prefix + FUSED_GATE_UP, shape=(spec.experts, 2 * i, h), pieces=tuple(gate_up),
                         slabs=spec.experts),
                 replace(first_down, key=prefix + FUSED_DOWN, shape=(spec.experts, h, i), pieces=tuple(down),
                         slabs=spec.experts)]
        replaced[names[0][0]] = fused
        dropped.update(key for expert in names for key in expert)
        router = by_key[prefix + moe.names.router]
        replaced[router.key] = [replace(router, key=prefix + FUSED_ROUTER)]
    out: list[OutTensor] = []
    for tensor in tensors:
        if tensor.key in replaced:
            out += replaced[tensor.key]
        elif tensor.key not in dropped:
            out.append(tensor)
    return out

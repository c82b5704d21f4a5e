"""Llama (``model_type: llama``): the reference family, the layout of docs/nxd-format.md §3."""

from __future__ import annotations

from ckptconv.core.families.base import Family, LayerRule
from ckptconv.core.families.rules import (
    GateUpRule,
    OutProjRule,
    QkvRule,
    ReplicatedRule,
    RowRule,
    half_head_dim,
    hidden,
    intermediate,
)

DENSE_MLP: tuple[LayerRule, ...] = (GateUpRule(), RowRule("mlp.down_proj.weight", out_size=hidden, in_size=intermediate))


def decoder_rules(*, qkv: QkvRule, extra: tuple[LayerRule, ...] = (),
                  mlp: tuple[LayerRule, ...] = DENSE_MLP) -> tuple[LayerRule, ...]:
    """A Llama-shaped decoder layer in HF module order; ``extra`` goes after o_proj (e.g. Qwen3's q/k norms),
    ``mlp`` are the MLP's rules (a mixture of experts: the router's and the experts').

    Older transformers registered ``rotary_emb`` right after ``o_proj``, so its per-layer ``inv_freq``
    buffer sits there (optional: present in a source, it is carried through).
    """
    return (
        qkv,
        OutProjRule(),
        *extra,
        ReplicatedRule("self_attn.rotary_emb.inv_freq", half_head_dim, optional=True),
        *mlp,
        ReplicatedRule("input_layernorm.weight", hidden),
        ReplicatedRule("post_attention_layernorm.weight", hidden),
    )


LLAMA = Family(model_type="llama", name="Llama", hf_class="LlamaForCausalLM", layer_rules=decoder_rules(qkv=QkvRule()))

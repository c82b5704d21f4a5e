"""Mixtral (``model_type: mixtral``) and Qwen3-MoE (``model_type: qwen3_moe``): Llama's and Qwen3's attention with a
mixture of experts for an MLP (rules in :mod:`ckptconv.core.families.moe`).

Mixtral: every layer sparse, ``num_local_experts`` experts of ``intermediate_size``, top-k weights always
renormalized, Mistral's ``sliding_window``. Qwen3-MoE: ``num_experts`` experts of ``moe_intermediate_size``; a
layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (as
``Qwen3MoeDecoderLayer`` decides), its dense layers a Qwen3 MLP of ``intermediate_size``; top-k weights
renormalized when ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.families.base import Family, Refusal
from ckptconv.core.families.llama import decoder_rules
from ckptconv.core.families.moe import MIXTRAL_NAMES, QWEN3_MOE_NAMES, ExpertsRule, MoeConfig, RouterRule
from ckptconv.core.families.qwen import _SLIDING, QWEN3
from ckptconv.core.families.rules import QkvRule


def _qwen3_sparse(config: dict[str, Any], layer: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


_MIXTRAL_MOE = MoeConfig("num_local_experts", "intermediate_size", MIXTRAL_NAMES)
MIXTRAL = Family(
    model_type="mixtral", name="Mixtral", hf_class="MixtralForCausalLM",
    layer_rules=decoder_rules(qkv=QkvRule(), mlp=(RouterRule(MIXTRAL_NAMES), ExpertsRule(MIXTRAL_NAMES))),
    window_key="sliding_window", moe=_MIXTRAL_MOE,
    sparse_rules=decoder_rules(qkv=QkvRule(), mlp=(RouterRule(MIXTRAL_NAMES), ExpertsRule(MIXTRAL_NAMES))),
)

_QWEN3_EXTRA = tuple(r for r in QWEN3.layer_rules if getattr(r, "name", "").startswith("self_attn.") and
                     getattr(r, "name", "").endswith("_norm.weight"))
QWEN3_MOE = Family(
    model_type="qwen3_moe", name="Qwen3-MoE", hf_class="Qwen3MoeForCausalLM",
    layer_rules=QWEN3.layer_rules,
    refusals=(*_SLIDING, Refusal("attention_bias", "q/k/v/o biases are not part of the Qwen3 layout")),
    moe=MoeConfig("num_experts", "moe_intermediate_size", QWEN3_MOE_NAMES, sparse=_qwen3_sparse,
                  norm_topk=lambda config: bool(config.get("norm_topk_prob", False)), aliases=("num_local_experts",), cast_topk=True),
    sparse_rules=decoder_rules(qkv=QkvRule(), extra=_QWEN3_EXTRA,
                               mlp=(RouterRule(QWEN3_MOE_NAMES), ExpertsRule(QWEN3_MOE_NAMES))),
)

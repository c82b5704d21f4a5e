"""Qwen2 / Qwen2.5 (``model_type: qwen2``: q/k/v biases) and Qwen3 (``model_type: qwen3``: per-head q/k norms).

Qwen2's ``q_proj``/``k_proj``/``v_proj`` biases are split and replicated exactly like their weight rows
(``qkv_proj.bias_q/_k/_v``, ``bias_qkv`` fused). Qwen3's ``q_norm``/``k_norm`` (``[head_dim]``, applied per
head after the projection and before RoPE) are replicated on every tp rank under the names optimum-neuron's
Qwen3 uses (the HF ones). Sliding-window layers (``use_sliding_window: true``) are refused.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.families.base import Family, Refusal
from ckptconv.core.families.llama import decoder_rules
from ckptconv.core.families.rules import QkvRule, ReplicatedRule, head_dim


def _has_sliding_layers(layer_types: Any) -> bool:
    return isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types)


_SLIDING = (
    Refusal("use_sliding_window", "sliding-window layers are not supported (only full attention)"),
    Refusal("layer_types", "sliding-window layers are not supported (only full_attention layers)", _has_sliding_layers),
)

QWEN2 = Family(model_type="qwen2", name="Qwen2", hf_class="Qwen2ForCausalLM",
               layer_rules=decoder_rules(qkv=QkvRule(bias=True)), refusals=_SLIDING)

QWEN3 = Family(
    model_type="qwen3", name="Qwen3", hf_class="Qwen3ForCausalLM",
    layer_rules=decoder_rules(qkv=QkvRule(), extra=(ReplicatedRule("self_attn.q_norm.weight", head_dim),
                                                     ReplicatedRule("self_attn.k_norm.weight", head_dim))),
    refusals=(*_SLIDING, Refusal("attention_bias", "q/k/v/o biases are not part of the Qwen3 layout")),
)

"""Mistral (``model_type: mistral``): Llama's layer, an explicit ``head_dim`` and a sliding attention window.

``sliding_window`` (null: full causal attention) limits each query to that many keys, itself included, as
``MistralForCausalLM`` masks them; the shards are Llama's.
"""

from __future__ import annotations

from ckptconv.core.families.base import Family
from ckptconv.core.families.llama import decoder_rules
from ckptconv.core.families.rules import QkvRule

MISTRAL = Family(model_type="mistral", name="Mistral", hf_class="MistralForCausalLM",
                 layer_rules=decoder_rules(qkv=QkvRule()), window_key="sliding_window")

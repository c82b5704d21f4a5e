"""The model families ckptconv and nxdtrain know, by HF ``model_type``: one file each, registered here.

    >>> family_for({"model_type": "llama"}).hf_class
    'LlamaForCausalLM'
    >>> family_for({"model_type": "deepseek_v2"})
    Traceback (most recent call last):
    ...
    ckptconv.errors.ConversionError: config.json: model_type is 'deepseek_v2' (a mixture-of-experts model with shared experts and a group-limited router, not supported yet); supported: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, gpt_oss, deepseek_v3, kimi_k2
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.families.base import Family, Refusal
from ckptconv.core.families.deepseek_v3 import DEEPSEEK_V3
from ckptconv.core.families.gpt_oss import GPT_OSS
from ckptconv.core.families.llama import LLAMA
from ckptconv.core.families.mistral import MISTRAL
from ckptconv.core.families.moe_families import MIXTRAL, QWEN3_MOE
from ckptconv.core.families.qwen import QWEN2, QWEN3
from ckptconv.errors import ConversionError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, GPT_OSS)}
FAMILIES |= {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": DEEPSEEK_V3}  # Kimi K2: DeepSeek-V3's architecture, its own name
# Known model types with a feature the seam has no rule for yet (docs/architecture.md, "Adding an MoE family").
NOT_YET = {
    "qwen2_moe": "a mixture-of-experts model with a gated shared expert",
    "deepseek_v2": "a mixture-of-experts model with shared experts and a group-limited router",
}

__all__ = ["FAMILIES", "LLAMA", "Family", "Refusal", "family_for", "supported"]


def supported() -> str:
    return ", ".join(FAMILIES)


def family_for(config: dict[str, Any], source: str = "config.json") -> Family:
    """The family of an HF config (no ``model_type``: Llama), its refusals checked."""
    model_type = config.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        why = f" ({NOT_YET[model_type]}, not supported yet)" if model_type in NOT_YET else ""
        raise ConversionError(f"{source}: model_type is {model_type!r}{why}; supported: {supported()}")
    family.check_config(config, source)
    return family

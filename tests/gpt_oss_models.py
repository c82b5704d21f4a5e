"""Tiny GPT-OSS models made by transformers for the tests (main lane and TorchTitan lane).

``make_gpt_oss``: hidden 32 != expert intermediate 24 (multiples of 8: TorchTitan's CPU grouped matmul), 4 query heads
over 2 KV heads (head_dim 8), 4 experts top-2, three layers sliding / full / sliding with a window of 4 (sequences of
24 see it), YaRN factor 32 (its ramp and attention factor move the logits), and every sink and bias random (transformers
initializes them to zero).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

E, TOP_K, WINDOW = 4, 2, 4


def gpt_oss_config(**overrides: Any) -> Any:
    import transformers

    values: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=E, num_experts_per_tok=TOP_K, vocab_size=128, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=131072,
        initializer_range=0.2, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 4096})
    values.update(overrides)
    return transformers.GptOssConfig(**values)


def gpt_oss_model(seed: int = 1, **overrides: Any) -> Any:
    """The transformers model (fp32, eval), its sinks and biases random."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(gpt_oss_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)
    return model


def make_gpt_oss(out: Path, *, seed: int = 1, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    model = gpt_oss_model(seed, **overrides).to(dtype)
    model.save_pretrained(out)
    return out

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


def make_mxfp4_pair(quantized: Path, twin: Path, *, seed: int = 3) -> tuple[Path, Path]:
    """An MXFP4 GPT-OSS checkpoint (random FP4 codes and e8m0 scales for every expert weight, stored as ``*_blocks`` /
    ``*_scales`` with ``quantization_config`` mxfp4, the rest bf16) and its twin: the same model with the experts
    dequantized by transformers' own ``convert_moe_packed_tensors``, saved plain in bf16. Hidden = intermediate = 32
    (MXFP4 blocks hold 32 values of a row)."""
    import json

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    make_gpt_oss(twin, seed=seed, dtype=torch.bfloat16, intermediate_size=32)
    state = {k: v.clone() for k, v in _load(twin).items()}
    generator = torch.Generator().manual_seed(seed)
    packed = dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = state[key].shape  # plain [E, in, out]: MXFP4 stores [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=generator)
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        state[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(state, twin / "model.safetensors", metadata={"format": "pt"})
    quantized.mkdir(parents=True, exist_ok=True)
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((twin / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, twin


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")

"""Tiny DeepSeek-V3 checkpoints built by transformers' ``DeepseekV3ForCausalLM`` for the DeepSeek-V3 tests (main lane and
TorchTitan lane), and an FP8 twin made from one.

Shapes that expose the bugs this family invites: 8 routed experts, top-2, in 4 groups of which 2 are kept (n_group > 1,
topk_group < n_group); hidden 32 != expert intermediate 16 != dense 48 != shared 32 (2 shared experts); MLA dims all
distinct (nope 12, rope 8, v 10, kv_lora 16, q_lora 24); one dense layer then two sparse; YaRN factor 8 with a
max_position of 256 over an original 32 (it changes the logits: tested); a trained (non-zero, distinct)
``e_score_correction_bias``; every weight random and distinct (norms not ones), router weights large enough that the
choice varies by token. ``mtp=True`` adds one MTP layer as
DeepSeek's release names it (``model.layers.3.*``: a sparse decoder layer, ``enorm``, ``hnorm``, ``eh_proj``
``[H, 2H]``, ``shared_head.norm``, and ``embed_tokens`` / ``shared_head.head`` equal to the model's), which
transformers does not build.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LAYERS, E, TOP_K, H, V = 3, 8, 2, 32, 96
YARN = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}


def config_kwargs(*, q_lora_rank: int | None = 24, rope_interleave: bool = True, yarn: bool = True,
                  **extra: Any) -> dict[str, Any]:
    return dict(vocab_size=V, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                n_routed_experts=E, num_experts_per_tok=TOP_K, n_group=4, topk_group=2, first_k_dense_replace=1,
                q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=rope_interleave,
                rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
                max_position_embeddings=256, num_nextn_predict_layers=1, tie_word_embeddings=False, **extra)


def build_model(seed: int = 0, **kwargs: Any) -> Any:
    """A random ``DeepseekV3ForCausalLM`` (fp32) with every weight distinct and a trained router bias."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config_kwargs(**kwargs))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.05 * torch.randn_like(param))
        for layer in model.model.layers[1:]:  # scores that vary by token (every expert chosen), a bias that matters
            layer.mlp.gate.weight.mul_(6.0)
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(E))
    return model


def make_deepseek(path: Path, *, mtp: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0,
                  **kwargs: Any) -> Path:
    """``save_pretrained`` of :func:`build_model` (in ``dtype``; the router bias stays fp32 as transformers keeps it),
    plus an MTP layer as the release names it (``mtp``)."""
    model = build_model(seed, **kwargs)
    model.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    state = {k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in state.items()}
    if mtp:  # else the config states an MTP layer the weights do not hold (what transformers' save gives)
        state.update(mtp_tensors(state, seed))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def mtp_tensors(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """MTP layer ``LAYERS`` as DeepSeek-V3's release names it: a sparse decoder layer (random, distinct from the last
    one), its own norms and ``eh_proj``, and copies of the model's embedding and head."""
    gen = torch.Generator().manual_seed(seed + 1)
    last, mtp = f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."
    out = {}
    for key, value in state.items():
        if key.startswith(last):
            fresh = torch.randn(value.shape, generator=gen) * (0.1 if "norm" in key else 0.05)
            out[mtp + key[len(last):]] = (fresh + (1.0 if "norm" in key else 0.0)).to(value.dtype)
    dtype = state["model.embed_tokens.weight"].dtype
    for name, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("shared_head.norm.weight", (H,))):
        out[mtp + name] = (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
    out[mtp + "eh_proj.weight"] = (0.05 * torch.randn((H, 2 * H), generator=gen)).to(dtype)
    out[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return out


# ---- FP8 with a scale per block (DeepSeek-V3's release format), written independently of ckptconv's reader ----

BLOCK = 16  # does not divide 24, 40, 88 or 120: partial blocks at the edges
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The weights DeepSeek's release quantizes: every linear layer's, not the embedding, head, norms or router."""
    return [k for k, v in state.items() if v.dim() == 2 and "embed_tokens" not in k and "head" not in k
            and not k.endswith("mlp.gate.weight") and "norm" not in k]


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and the float32 ``weight_scale_inv`` (one per block, the block's largest |value| / 448)."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    w = weight.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The plain bf16 value of each entry: its float8 value times its block's scale, in fp32 (element by element)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = (
                q[i * block:(i + 1) * block, j * block:(j + 1) * block].float() * scale[i, j])
    return out.to(torch.bfloat16)


def make_fp8(src: Path, fp8: Path, twin: Path, *, block: int = BLOCK) -> list[str]:
    """From the bf16 checkpoint ``src``: ``fp8`` (quantized weights with their scales, ``quantization_config`` as the
    release writes it) and ``twin`` (the same model with those weights dequantized by :func:`dequantize`, no
    quantization). Returns the quantized names."""
    state = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    names = quantized_names(state)
    quantized, plain = dict(state), dict(state)
    for name in names:
        q, scale = quantize(state[name], block)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        plain[name] = dequantize(q, scale, block)
    for folder, tensors, conf in (
            (fp8, quantized, {**config, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                                 "quant_method": "fp8",
                                                                 "weight_block_size": [block, block]}}),
            (twin, plain, config)):
        folder.mkdir(parents=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(conf, indent=2))
    return names

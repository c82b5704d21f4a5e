"""Inputs built the way the official converter's world makes them (docs/nxd-format.md §3 and §4).

- :func:`old_transformers_llama`: a checkpoint of an older transformers, whose ``LlamaAttention``
  registered ``rotary_emb`` after ``o_proj`` and so saved a per-layer fp32 ``inv_freq`` there.
- :func:`official_tied_shards`: the shards the official converter writes for a tied model: the
  same ``torch.save`` of a plain dict per file, with no ``lm_head.weight``, and nothing else.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.conftest import hf_state, make_tiny_llama

INV_FREQ = "self_attn.rotary_emb.inv_freq"


def old_inv_freq(config: dict, layer: int) -> torch.Tensor:
    """fp32 ``1 / theta^(2i/hd)`` as older transformers stored it; scaled per layer so that a
    layer mix-up shows (the converter copies these buffers, it never computes with them)."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = float(config.get("rope_theta", 10000.0))
    base = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    return base * (1.0 + layer / 64)


def old_transformers_llama(path: Path, **model: object) -> Path:
    """``path/hf`` (safetensors + config.json) and ``path/merged.pt`` (the official tool's input:
    one ``torch.save`` in module order) of a tiny bf16 Llama carrying per-layer ``inv_freq``."""
    hf = make_tiny_llama(path / "made", dtype=torch.bfloat16, **model)  # type: ignore[arg-type]
    config = json.loads((hf / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    # save_pretrained's module order: embedding, then per layer q, k, v, o, (rotary_emb), mlp, norms, ...
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        order = list(LlamaForCausalLM(LlamaConfig(**config)).state_dict())
    tensors = hf_state(hf)
    for key in order:
        if key not in tensors:
            continue  # a tied lm_head
        state[key] = tensors[key]
        if key.endswith("self_attn.o_proj.weight"):
            layer = int(key.split(".")[2])
            state[key.removesuffix("o_proj.weight") + "rotary_emb.inv_freq"] = old_inv_freq(config, layer)
    from safetensors.torch import save_file

    (path / "hf").mkdir(parents=True)
    save_file(state, path / "hf" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(hf / "config.json", path / "hf" / "config.json")
    torch.save(state, path / "merged.pt")
    shutil.rmtree(hf)
    return path


def official_tied_shards(ours: Path, out: Path) -> Path:
    """``out/model``: every shard of ``ours`` rewritten by ``torch.save`` (the official writer)
    with ``lm_head.weight`` dropped; no ``ckptconv.json`` and no ``hf/`` (the official tool
    writes neither)."""
    (out / "model").mkdir(parents=True)
    for shard in sorted((ours / "model").glob("*.pt")):
        state = torch.load(shard, weights_only=True)
        state.pop("lm_head.weight", None)
        torch.save(state, out / "model" / shard.name)
    return out

"""Synthetic HF Llama checkpoints in real shapes (Llama-3-8B / -70B / -3.1-405B dimensions, any layer count); any other family
from its config (``write_config``: benchmarks/moe.py's Mixtral).

Written as a sharded safetensors directory with ``config.json`` and ``model.safetensors.index.json``,
tensor by tensor through the streaming writer, so generating a 20 GB model needs little memory.
Values are pseudo-random finite bf16 numbers (no NaN/Inf, so replica checks compare cleanly).

    python benchmarks/synth.py OUT --shape 70b --layers 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ckptconv.core.mapping import hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.hf import SAFETENSORS_INDEX
from ckptconv.io.safetensors_io import SafetensorsWriter, plan_safetensors

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128, num_key_value_heads=8),
    # 70B's heads (64 query, 8 K/V) with tiny tensors: its file and key structure at any tp, pp (reads per rank)
    "70b-tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=64, num_key_value_heads=8),
}
COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, rms_norm_eps=1e-5,
              rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16")
CHUNK = 32 * 2**20  # bytes generated and written at a time
SHARD_BYTES = 5 * 10**9


def config_for(shape: str, layers: int, vocab: int | None = None) -> dict:
    """The shape's config with ``layers`` layers (and, to keep a benchmark's disk use down, another vocabulary)."""
    config = {**COMMON, **SHAPES[shape], "num_hidden_layers": layers}
    return config if vocab is None else {**config, "vocab_size": vocab}


def _fill(writer: SafetensorsWriter, key: str, nbytes: int, rng: np.random.Generator) -> None:
    for offset in range(0, nbytes, CHUNK):
        n = min(CHUNK, nbytes - offset) // 2
        bits = rng.integers(0, 2**16, size=n, dtype=np.uint16) & 0xBFFF  # exponent < 128: finite
        writer.write_extent(key, offset, torch.from_numpy(bits).view(torch.bfloat16))


def write_model(out: Path, shape: str, layers: int, seed: int = 0, vocab: int | None = None) -> int:
    """Write the model; return its weight bytes."""
    return write_config(out, config_for(shape, layers, vocab), seed)


def write_config(out: Path, config: dict, seed: int = 0) -> int:
    """Write a model of any family ckptconv knows (a mixture of experts too) from its HF ``config``; return its
    weight bytes."""
    shapes = hf_shapes(ModelSpec.from_config(config), with_inv_freq=False)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for key, shp in shapes.items():
        nbytes = int(np.prod(shp)) * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        layout = plan_safetensors({k: (torch.bfloat16, shapes[k]) for k in keys}, {"format": "pt"})
        writer = SafetensorsWriter(out / name, layout)
        for key in keys:
            nbytes = int(np.prod(shapes[key])) * 2
            _fill(writer, key, nbytes, rng)
            weight_map[key] = name
            total += nbytes
        writer.finish()
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    total = write_model(args.out, args.shape, args.layers, args.seed)
    print(f"{args.out}: {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()

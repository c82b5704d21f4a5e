"""The GPT-OSS row of ``make bench``: a GPT-OSS-120B-shaped MXFP4 checkpoint (hidden 2880, 128 experts of intermediate
2880 top-4, 64 query / 8 KV heads of 64, the experts as ``*_blocks`` / ``*_scales``, the rest bf16; a few layers, a
small vocabulary) into TorchTitan's DCP with ``to-dcp``, paired with ``cp -r`` of the same input (benchmarks/run.py's
harness): ratio to cp, CPU seconds per GB written, peak RSS. One layer is 1.7 GB of MXFP4 in and 6.4 GB of bf16 out.
TorchTitan's own ``convert_from_hf`` is a script of its repository (scripts/checkpoint_conversion), not part of the
0.3.0 package, so it is not run here.

    python benchmarks/run.py --gpt-oss [--layers N] [--repeat N]
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptconv.core.mapping import hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.hf import SAFETENSORS_INDEX
from ckptconv.io.safetensors_io import SafetensorsWriter, plan_safetensors

GPT_OSS_120B = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
                    num_local_experts=128, num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, sliding_window=128, rms_norm_eps=1e-5, swiglu_limit=7.0, vocab_size=1024,
                    max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                    quantization_config={"quant_method": "mxfp4"})
CHUNK = 32 * 2**20


def _stored(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors an MXFP4 checkpoint stores: each expert weight ``[E, in, out]`` as blocks and scales."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = shape
            out[key + "_blocks"] = (torch.uint8, (e, rows, cols // 32, 16))
            out[key + "_scales"] = (torch.uint8, (e, rows, cols // 32))
        else:
            out[key] = (torch.bfloat16, shape)
    return out


def write_gpt_oss(out: Path, layers: int, seed: int = 0) -> int:
    """One safetensors file per layer (and one for the rest): random FP4 codes, e8m0 scales near 1, finite bf16."""
    config = {**GPT_OSS_120B, "num_hidden_layers": layers,
              "layer_types": ["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(layers)]}
    stored = _stored(hf_shapes(ModelSpec.from_config(config), with_inv_freq=False))
    out.mkdir(parents=True, exist_ok=True)
    rng, weight_map, total = np.random.default_rng(seed), {}, 0
    groups: dict[str, list[str]] = {}
    for key in stored:
        groups.setdefault(key.split(".")[2] if key.startswith("model.layers.") else "rest", []).append(key)
    for i, keys in enumerate(groups.values(), start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        writer = SafetensorsWriter(out / name, plan_safetensors({k: stored[k] for k in keys}, {"format": "pt"}))
        for key in keys:
            dtype, shape = stored[key]
            nbytes = int(np.prod(shape)) * dtype.itemsize
            for offset in range(0, nbytes, CHUNK):
                n = min(CHUNK, nbytes - offset)
                if key.endswith("_scales"):
                    chunk = torch.from_numpy(rng.integers(120, 128, size=n, dtype=np.uint8))
                elif dtype == torch.uint8:
                    chunk = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8))
                else:
                    bits = rng.integers(0, 2**16, size=n // 2, dtype=np.uint16) & 0xBFFF  # finite
                    chunk = torch.from_numpy(bits).view(torch.bfloat16)
                writer.write_extent(key, offset, chunk)
            weight_map[key] = name
            total += nbytes
        writer.finish()
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return total


def gpt_oss_rows(out: Path, convert: Callable[..., Any], cpu_seconds: list[float], layers: int,
                 repeat: int) -> tuple[list[Any], list[str]]:
    """to-dcp of a GPT-OSS-120B-shaped MXFP4 model under ``out`` with run.py's ``convert``; the row and its CPU line."""
    hf, dcp = out / f"hf-gpt-oss-120b-mxfp4-{layers}l", out / "dcp-gpt-oss"
    shutil.rmtree(hf, ignore_errors=True)
    print(f"generating {hf.name} (GPT-OSS-120B layer shapes, MXFP4 experts, {layers} layers, vocab 1024) ...",
          flush=True)
    write_gpt_oss(hf, layers)
    row = convert(f"to-dcp gpt-oss-120b mxfp4 x{layers} layers", ["to-dcp", str(hf), str(dcp)], hf, dcp, repeat)
    seconds = cpu_seconds[-1]
    shutil.rmtree(dcp)
    shutil.rmtree(hf)
    return [row], [f"{row.case}: CPU {seconds:.1f} s (user + system, last run), "
                   f"{seconds / (row.bytes_written / 1e9):.2f} CPU s/GB written"]

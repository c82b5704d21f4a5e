"""The DeepSeek-V3 rows of ``make bench``: DeepSeek-V3-671B's layer shapes (hidden 7168, MLA with q_lora 1536, kv_lora
512, 128 heads of 128 + 64 (v 128); a dense layer of 18432; 256 routed experts of 2048, top-8 in 8 groups, one shared
expert), one dense and one MoE layer, a vocabulary of 1024 (the 129280-row embedding and head would add 3.7 GB of
bf16 that is not the point here), stored as the release stores it: every linear weight float8_e4m3fn with a float32
``weight_scale_inv`` per 128 x 128 block. About 12 GB of FP8 in, 24 GB of bf16 out.

``to-dcp`` (dequantizing as it streams) is paired with ``cp -r`` of the same input (benchmarks/run.py's harness):
ratio to cp, CPU s/GB written, peak RSS. In the same run, TorchTitan's own ``convert_from_hf`` (its
``scripts/checkpoint_conversion/convert_from_hf.py``, the steps of which :func:`titan_convert` repeats against
TorchTitan 0.3.0's API: build the model on CPU, ``to_hf`` of its state dict, ``dcp.load`` through its
``QuantizedHuggingFaceStorageReader``, ``from_hf``, ``dcp.save``) runs on the same input, in the TorchTitan venv,
under an address-space limit (``--titan-limit``, default 16 GiB) so that on a shared machine it fails where it
would need more rather than take the machine's memory: its time and peak RSS, or where it fails.

    python benchmarks/run.py --deepseek [--experts N] [--repeat N]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptconv.core.mapping import hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.hf import SAFETENSORS_INDEX
from ckptconv.io.safetensors_io import SafetensorsWriter, plan_safetensors

BLOCK = 128
CHUNK = 32 * 2**20
SHARD_BYTES = 5 * 10**9
DEEPSEEK_V3_671B = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
    first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    rope_theta=10000, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
    vocab_size=1024, num_nextn_predict_layers=0,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [BLOCK, BLOCK]})
# the TorchTitan venv (make setup-titan): this tree's, else $TITAN_PYTHON
TITAN_PYTHON = Path(os.environ.get("TITAN_PYTHON") or Path(__file__).resolve().parent.parent / ".venv-titan/bin/python")


def quantized(key: str, shape: tuple[int, ...]) -> bool:
    """What the release quantizes: every linear weight but the embedding, the head and the router."""
    return len(shape) == 2 and not key.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))


def _fill(writer: SafetensorsWriter, key: str, nbytes: int, dtype: torch.dtype, rng: np.random.Generator) -> None:
    """Pseudo-random finite values: float8_e4m3fn with the top exponent bit clear, bf16 with exponent < 128,
    float32 scales in [1e-4, 1e-3)."""
    size = dtype.itemsize
    for offset in range(0, nbytes, CHUNK):
        n = min(CHUNK, nbytes - offset) // size
        if dtype == torch.float8_e4m3fn:
            data = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8) & 0xBF).view(dtype)
        elif dtype == torch.float32:
            data = torch.from_numpy(rng.uniform(1e-4, 1e-3, size=n).astype(np.float32))
        else:
            data = torch.from_numpy(rng.integers(0, 2**16, size=n, dtype=np.uint16) & 0xBFFF).view(dtype)
        writer.write_extent(key, offset, data)


def write_fp8_model(out: Path, config: dict[str, Any], seed: int = 0) -> int:
    """The model as FP8 blocks (sharded safetensors, index, config.json), tensor by tensor; returns its bytes."""
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, shape in hf_shapes(ModelSpec.from_config(plain), with_inv_freq=False).items():
        if quantized(key, shape):
            tensors[key] = (torch.float8_e4m3fn, shape)
            tensors[key + "_scale_inv"] = (torch.float32, (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)))
        else:
            tensors[key] = (torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16, shape)
    groups: list[list[str]] = [[]]
    size = 0
    for key, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        writer = SafetensorsWriter(out / name, plan_safetensors({k: tensors[k] for k in keys}, {"format": "pt"}))
        for key in keys:
            dtype, shape = tensors[key]
            nbytes = int(np.prod(shape)) * dtype.itemsize
            _fill(writer, key, nbytes, dtype, rng)
            weight_map[key], total = name, total + nbytes
        writer.finish()
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return total


# TorchTitan's convert_from_hf, its steps against 0.3.0's API, the model from the config to-dcp generated
_TITAN_CONVERT = r"""
import resource, sys, time, importlib.util, warnings
import torch, torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
hf, out, config_py = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("generated", config_py)
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
start = time.perf_counter()
try:
    with torch.inference_mode():
        model_config = module.model_config()
        with torch.device("cpu"):
            model = ModelWrapper(model_config.build())
        adapter = DeepSeekV3StateDictAdapter(model_config, hf)
        state = model._get_state_dict()
        hf_state = adapter.to_hf(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(hf, from_quantized=True))
            dcp.save(adapter.from_hf(hf_state), checkpoint_id=out)
    outcome = "done"
except BaseException as exc:
    outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
print(f"{outcome}|{time.perf_counter() - start:.1f}|{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")
"""


def titan_convert(hf: Path, out: Path, config_py: Path, limit: int) -> str:
    """TorchTitan's convert_from_hf of ``hf`` into ``out`` under an address-space limit of ``limit`` bytes: its wall
    time, peak RSS, or where it failed."""
    if not TITAN_PYTHON.is_file():
        return f"not run: no TorchTitan venv at {TITAN_PYTHON} (make setup-titan)"
    argv = ["prlimit", f"--as={limit}", str(TITAN_PYTHON), "-c", _TITAN_CONVERT, str(hf), str(out), str(config_py)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if last.count("|") != 2:
        return f"exit {proc.returncode} after {wall:.0f} s: {proc.stderr.strip().splitlines()[-1:]}"
    outcome, seconds, rss = last.split("|")
    return (f"{outcome} after {float(seconds):.1f} s (wall with start-up {wall:.1f} s), peak RSS "
            f"{int(rss) / 2**30:.2f} GiB, under an address-space limit of {limit / 2**30:.0f} GiB")


def deepseek_rows(out: Path, convert: Callable[..., Any], cpu_seconds: list[float], experts: int, repeat: int,
                  titan_limit: int) -> tuple[list[Any], list[str]]:
    """to-dcp of the FP8 model (``experts`` routed experts) with run.py's ``convert``, then TorchTitan's convert on
    the same input; the rows and the notes (CPU s/GB written, TorchTitan's outcome)."""
    hf = out / f"hf-deepseek-v3-fp8-{experts}e"
    shutil.rmtree(hf, ignore_errors=True)
    print(f"generating {hf.name} (DeepSeek-V3-671B layer shapes, FP8 128 x 128 blocks, {experts} experts) ...",
          flush=True)
    total = write_fp8_model(hf, {**DEEPSEEK_V3_671B, "n_routed_experts": experts})
    dcp = out / "dcp-deepseek-v3"
    label = f"to-dcp deepseek-v3-671b shapes (1 dense + 1 MoE layer, {experts} experts), FP8 -> bf16"
    row = convert(label, ["to-dcp", str(hf), str(dcp)], hf, dcp, repeat)
    notes = [f"{label}: {total / 1e9:.2f} GB FP8 in, CPU {cpu_seconds[-1]:.1f} s (user + system, last run), "
             f"{cpu_seconds[-1] / (row.bytes_written / 1e9):.2f} CPU s/GB written"]
    config_py = dcp / "torchtitan_config.py"
    kept = out / "deepseek_torchtitan_config.py"
    shutil.copy(config_py, kept)
    shutil.rmtree(dcp)  # the disk for TorchTitan's output
    titan_out = out / "dcp-deepseek-v3-titan"
    shutil.rmtree(titan_out, ignore_errors=True)
    print("TorchTitan's convert_from_hf on the same input ...", flush=True)
    notes.append("TorchTitan 0.3.0 convert_from_hf (same input): "
                 f"{titan_convert(hf, titan_out, kept, titan_limit)}")
    shutil.rmtree(titan_out, ignore_errors=True)
    shutil.rmtree(hf)
    return [row], notes

"""nxdtrain on a CUDA device: NCCL, the device's kernels, bf16, FSDP2, activation offloading and MoE on a GPU.

Skipped where torch sees no CUDA device (CI has none); ``make test-gpu`` runs them where one is. One process per
world: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and the machines these ran on had one, so the
multi-rank collectives (tp all-reduce, ep all-to-all, FSDP2's all-gather over dp > 1) are covered on CPU with gloo,
by the same code. References run on the CPU: transformers' class of the family, trained on the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.cli import PRELOAD
from nxdtrain.config.options import TrainConfig
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import export, run_worker
from tests.conftest import warns_no_tokenizer
from tests.nxdtrain.harness import WORLD_TIMEOUT, read_log, train_options
from tests.nxdtrain.test_parity import assert_matches_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")

# fp32 on a GPU: other kernels, other summation orders; TF32 stays off (torch's default for matmul), so the
# differences are fp32 rounding, far below what a wrong layout, mask or scaling would give (~1e-1).
LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-3


def train_on_cuda(tmp_path: Path, src: Path, **options: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One process on cuda:0; returns the jsonl log and what the worker saw (device, backend, peak memory)."""
    seen = tmp_path / "seen.json"
    flat = {"resume": str(src), "device": "cuda", "checkpoint_dir": str(tmp_path / "ckpt"),
            "log_jsonl": str(tmp_path / "log.jsonl"), **options}
    code = spawn(_worker, (TrainConfig.from_flat(flat), str(seen)), 1, timeout_s=WORLD_TIMEOUT, preload=PRELOAD)
    assert code == 0, f"cuda run exited with {code}"
    return read_log(tmp_path / "log.jsonl"), json.loads(seen.read_text())


def _worker(config: TrainConfig, seen: str) -> None:
    torch.cuda.reset_peak_memory_stats()
    run_worker(config)
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else None
    Path(seen).write_text(json.dumps({"peak": torch.cuda.max_memory_allocated(), "backend": backend,
                                      "device": torch.cuda.get_device_name(), "cuda_used": torch.cuda.is_initialized()}))


@pytest.mark.parametrize("shard", [False, True], ids=["plain", "fsdp2"])
def test_fp32_on_cuda_matches_transformers(tmp_path, nxd_model, reference, shard):
    """GQA with heads != kv heads, AdamW, 3 steps: losses and exported weights are transformers' (on CPU)."""
    options = train_options(optimizer="adamw", mbs=2)
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    log, seen = train_on_cuda(tmp_path, src, shard_params=shard, **options)
    assert seen["cuda_used"] and seen["backend"] in ("nccl", None), seen
    with warns_no_tokenizer():
        export(tmp_path / "ckpt", tmp_path / "hf")
    assert_matches_reference(log, tmp_path / "hf", reference("gqa", **options), "adamw", loss_tol=LOSS_TOL,
                             weight_tol=WEIGHT_TOL)


def test_bf16_on_cuda_trains_close_to_fp32(tmp_path, nxd_model, reference):
    """bf16 parameters with fp32 masters on the GPU: within bf16 rounding of the fp32 reference."""
    options = train_options(optimizer="adamw", mbs=2)
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    log, _ = train_on_cuda(tmp_path, src, **{**options, "precision": "bf16"})
    ref_losses, _ = reference("gqa", **options)
    assert max(abs(r["loss"] - ref) for r, ref in zip(log, ref_losses, strict=True)) < 3e-2


def test_offloaded_activations_give_the_same_step_with_less_gpu_memory(tmp_path, nxd_model):
    """--offload-activations moves what the backward saves to pinned host memory: the same losses bit for bit,
    and a lower peak of GPU memory (rows long enough that activations dominate the tiny model's weights)."""
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    options = train_options(optimizer="adamw", seq_len=1024, gbs=8, mbs=8, steps=2)
    runs = {}
    for offload in (False, True):
        run = tmp_path / f"offload{int(offload)}"
        runs[offload] = train_on_cuda(run, src, offload_activations=offload, **options)
    (plain_log, plain), (off_log, off) = runs[False], runs[True]
    assert [r["loss"] for r in off_log] == [r["loss"] for r in plain_log]
    assert off["peak"] < 0.8 * plain["peak"], (off["peak"], plain["peak"])


def test_moe_on_cuda_matches_transformers(tmp_path):
    """Mixtral-style experts (hidden != intermediate, top-2 of 4) on the GPU: losses and aux loss match the
    transformers reference trained on CPU."""
    from tests.nxdtrain.harness import convert
    from tests.nxdtrain.moe_reference import make_moe, train_moe_reference

    hf = make_moe(tmp_path / "hf-moe", "mixtral", coef=0.02)
    src = convert(hf, tmp_path / "nxd-moe")
    options = train_options(optimizer="adamw", gbs=4, mbs=2, seq_len=16)
    log, seen = train_on_cuda(tmp_path / "run", src, **options)
    assert seen["cuda_used"]
    cfg = TrainConfig.from_flat(options | {"resume": "x"})
    ref_losses, ref_aux, _ = train_moe_reference(hf, cfg, tmp_path / "ref")
    assert max(abs(r["loss"] - x) for r, x in zip(log, ref_losses, strict=True)) <= LOSS_TOL
    assert max(abs(r["aux_loss"] - x) for r, x in zip(log, ref_aux, strict=True)) <= LOSS_TOL

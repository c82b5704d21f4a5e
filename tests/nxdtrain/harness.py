"""Running nxdtrain worlds from tests: N processes forked from a forkserver that imported the trainer once."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptconv.commands.api import RunOptions, to_nxd
from nxdtrain.cli import PRELOAD
from nxdtrain.config.options import TrainConfig
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import Trainer, prepare, run_worker

# A hung collective fails the test (gloo timeout) instead of hanging the suite; the spawn timeout backs it up.
DIST_TIMEOUT = 60.0
WORLD_TIMEOUT = 180.0

# Tiny Llamas (tests/conftest.make_tiny_llama); 3 layers so pp 2 splits them unevenly (1 + 2).
MODELS: dict[str, dict[str, Any]] = {
    "gqa": dict(heads=8, kv_heads=1, layers=3),          # tp 2 needs kv_size_multiplier 2
    "gqa2": dict(heads=8, kv_heads=2, layers=3),         # tp 4 needs kv_size_multiplier 2
    "gqa2-4": dict(heads=8, kv_heads=2, layers=4),       # pp 2 x vpp 2: one layer per virtual stage
    "mha": dict(heads=8, kv_heads=8, layers=3),
    "tied": dict(heads=8, kv_heads=2, layers=3, tied=True),
    # The other families (ckptconv.core.families): head_dim 16 != 64 / 8, Mistral's window 16 < rows of 32.
    "mistral": dict(model_type="mistral", heads=8, kv_heads=2, layers=3, head_dim=16, sliding_window=16),
    "qwen2": dict(model_type="qwen2", heads=8, kv_heads=2, layers=3),
    "qwen3": dict(model_type="qwen3", heads=8, kv_heads=2, layers=3, head_dim=16, tied=True),
    # A vocabulary no tp > 1 divides: the shards pad it (ckptconv.core.layout.ParallelLayout.padded_vocab).
    "vocab1003": dict(heads=8, kv_heads=2, layers=3, vocab=1003, tied=True),
}


def train_options(**overrides: Any) -> dict[str, Any]:
    """The options every parity run shares: fp32, synthetic rows, 3 steps, no warmup surprises."""
    base = dict(precision="fp32", data="synthetic", seq_len=16, gbs=4, mbs=1, steps=3, lr=1e-3, min_lr=1e-4,
                warmup=1, schedule="cosine", weight_decay=0.1, clip_grad=1.0, seed=7, dist_timeout=DIST_TIMEOUT)
    base.update(overrides)
    return base


def run_world(nproc: int, **options: Any) -> list[dict[str, Any]]:
    """Train in ``nproc`` processes; return the jsonl log (``log_jsonl`` must be among the options)."""
    config = TrainConfig.from_flat({"no_checkpoint": not options.get("checkpoint_dir"), **options})
    code = spawn(run_worker, (config,), nproc, timeout_s=WORLD_TIMEOUT, preload=PRELOAD)
    assert code == 0, f"training world of {nproc} exited with {code}"
    return read_log(Path(options["log_jsonl"]))


@contextlib.contextmanager
def trainer_world(options: dict[str, Any]) -> Iterator[tuple[Any, Callable[..., Trainer]]]:
    """Inside a spawned worker: this process joined to the world ``options`` describe, its environment, and a
    function building a Trainer from ``options`` with some replaced (``trainer(resume=...)``); the process group is
    destroyed at the end."""
    import torch.distributed as dist

    from nxdtrain.parallel.dist import detect_env, init_world

    config = TrainConfig.from_flat(options)
    env = detect_env()
    device = init_world(env, config.dist_timeout, prepare(config, env.world_size).device)

    def trainer(**overrides: Any) -> Trainer:
        return Trainer(prepare(TrainConfig.from_flat({**options, **overrides}), env.world_size), device)

    try:
        yield env, trainer
    finally:
        dist.destroy_process_group()


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def convert(hf: Path, out: Path, **layout: Any) -> Path:
    if not (out / "ckptconv.json").exists():
        to_nxd(hf, out, options=RunOptions(quiet=True, part=(0, 1)), **layout)
    return out

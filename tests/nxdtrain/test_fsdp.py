"""--shard-params / --hybrid-shard (torch's FSDP2): training equals transformers on the same global batch and the
same run without sharding; tags stay whole per-tp-rank shards that resume at another sharding, dp, or ZeRO-1.

4-process worlds take tens of seconds on a 2-core machine: tp2 x dp2 (AdamW) and the memory count run in the
default lane, the rest is marked slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import run_world, train_options
from tests.nxdtrain.test_parity import assert_matches_reference

LAYOUT = dict(attention="qkv_linear", kv_size_multiplier=2)  # gqa at tp 2: two ranks hold each K/V head


def lr(optimizer: str) -> float:
    return 0.05 if optimizer == "sgd" else 1e-3


def train(tmp: Path, src: Path, nproc: int, **options: Any) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A run of ``nproc`` processes from ``src`` saving into ``tmp/ckpt``; its log and its last tag exported."""
    log = run_world(nproc, resume=str(src), checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"),
                    **options)
    with warns_no_tokenizer():
        export(tmp / "ckpt", tmp / "hf")
    return log, hf_state(tmp / "hf")


CASES = {
    # name: (tp, dp, sharding options, optimizer)
    "tp2-dp2-adamw": (2, 2, {"shard_params": True}, "adamw"),
    "tp2-dp2-sgd": (2, 2, {"shard_params": True}, "sgd"),
    "tp1-dp2-adamw": (1, 2, {"shard_params": True}, "adamw"),
    "tp1-dp2-sgd": (1, 2, {"shard_params": True}, "sgd"),
    "tp1-dp4-hybrid2-adamw": (1, 4, {"hybrid_shard": 2}, "adamw"),
    "tp1-dp4-hybrid2-sgd": (1, 4, {"hybrid_shard": 2}, "sgd"),
}
DEFAULT_LANE = {"tp2-dp2-adamw"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_LANE else pytest.mark.slow)
                                  for n in CASES])
def test_sharded_matches_transformers_and_unsharded(tmp_path, nxd_model, reference, name):
    tp, dp, sharding, optimizer = CASES[name]
    options = train_options(optimizer=optimizer, lr=lr(optimizer), tp=tp, mbs=1)
    src = nxd_model("gqa", tp=tp, pp=1, **(LAYOUT if tp == 2 else dict(attention="qkv_linear")))
    sharded_log, sharded = train(tmp_path / "sharded", src, tp * dp, **options, **sharding)
    assert_matches_reference(sharded_log, tmp_path / "sharded/hf", reference("gqa", **options), optimizer)
    plain_log, plain = train(tmp_path / "plain", src, tp * dp, **options)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(sharded_log, plain_log, strict=True)) <= 1e-6
    worst = max((sharded[k] - plain[k]).abs().max().item() for k in plain)
    assert worst <= (1e-6 if optimizer == "sgd" else 1e-5), worst

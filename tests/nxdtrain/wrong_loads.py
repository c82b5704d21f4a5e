"""Tiny Llamas that have learnt something, and shards read with the wrong layout (nxdtrain.loss_check).

A random-init tiny model sits at ln(vocab) on any data, loaded right or wrong: it cannot tell the two
apart. :func:`trained_llama` first trains one (HF, AdamW) on :func:`pattern_rows` (arithmetic sequences
whose stride needs attention to read) until its loss is far below ln(vocab).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.conftest import make_tiny_llama

VOCAB = 128


def pattern_rows(count: int, seq_len: int, *, seed: int) -> list[list[int]]:
    """Rows ``s, s+d, s+2d, ... (mod VOCAB)`` with a random start and a stride d in 1..15."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count,), generator=g)
    strides = torch.randint(1, 16, (count,), generator=g)
    steps = torch.arange(seq_len)
    return ((starts[:, None] + strides[:, None] * steps[None, :]) % VOCAB).tolist()


def write_rows(path: Path, rows: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return path


def trained_llama(path: Path, *, steps: int, seq_len: int = 16, **shape: Any) -> tuple[Path, float]:
    """A tiny HF Llama trained ``steps`` AdamW steps on pattern rows; (its directory, its last loss)."""
    from transformers import LlamaForCausalLM

    init = make_tiny_llama(path.with_name(path.name + "-init"), vocab=VOCAB, **shape)
    model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = float("nan")
    for step in range(steps):
        ids = torch.tensor(pattern_rows(16, seq_len, seed=1000 + step))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = float(out.loss.detach())
    model.save_pretrained(path)  # a directory of its own: saving over the memory-mapped source keeps the old weights
    return path, loss


def claim_hw(converted: Path, hw: str) -> Path:
    """Make ``converted``'s ckptconv.json claim the head order ``hw`` (what a conversion with the wrong
    --hw-backend records): the shards stay as they were written, their reading changes."""
    meta_path = converted / "ckptconv.json"
    meta = json.loads(meta_path.read_text())
    meta["layout"]["hw"] = hw
    meta_path.write_text(json.dumps(meta))
    return converted

"""Tiny Llamas that have learnt something, and shards read with the wrong layout (nxdtrain.checkpoint.loss_check).

A random-init tiny model sits at ln(vocab) on any data, loaded right or wrong: it cannot tell the two
apart. :func:`trained_llama` first trains one (HF, AdamW) on :func:`pattern_rows` (arithmetic sequences
whose stride needs attention to read) until its loss is far below ln(vocab).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ckptconv.io.digest import DEFAULT, record_files
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


def pair_kv_wrongly(tag: Path) -> None:
    """Swap the K/V heads of tp ranks 0 <-> 1 and 2 <-> 3 in ``tag`` (tp 4, kvm 2, trn1's tiled replicas: rank r holds
    K/V head r % 2), and record the new files' digests so that the checked reads pass. The replicas stay consistent
    (ranks 0 and 2 still hold the same K/V head), so no structural check can see it: each query head now attends
    with the other group's K/V head, as shards written with the wrong head order do."""
    paths = [tag / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt" for r in range(4)]
    shards = [torch.load(p, weights_only=True) for p in paths]
    for a, b in ((0, 1), (2, 3)):
        for key in [k for k in shards[a] if k.endswith((".weight_k", ".weight_v"))]:
            shards[a][key], shards[b][key] = shards[b][key], shards[a][key]
    for shard, path in zip(shards, paths, strict=True):
        torch.save(shard, path)
    record_rewritten(tag, paths)


def record_rewritten(tag: Path, paths: list[Path]) -> None:
    """Record the digests of ``tag``'s rewritten ``paths`` in its ckptconv.json, so that the checked reads pass."""
    meta = json.loads((tag / "ckptconv.json").read_text())
    meta["files"].update({rel: rec.to_json() for rel, rec in record_files(paths, tag, DEFAULT).items()})
    (tag / "ckptconv.json").write_text(json.dumps(meta))

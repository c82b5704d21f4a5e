"""Activation checkpointing, the tp regions of separate q/k/v, and the pp 1 step, in one process (no process group)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptconv.commands.api import open_nxd
from ckptconv.core.layout import ParallelLayout, shard_name
from ckptconv.core.model_spec import ModelSpec
from ckptconv.io.nxd_read import load_shard
from nxdtrain.model.pipeline import PipelineStep, exchanged_shapes
from nxdtrain.model.stage import LlamaStage, SelfAttention, rank_heads
from nxdtrain.parallel.layers import TpGroup
from tests.nxdtrain.harness import convert


def loaded_stage(tmp_path, hf_model, recompute: str) -> LlamaStage:
    src = convert(hf_model("gqa2"), tmp_path / "nxd", attention="qkv_linear", fuse_qkv=True)
    opened = open_nxd(src)
    ckpt, spec, parsed = opened.ckpt, opened.spec, opened.layout
    ckpt.close()
    stage = LlamaStage(spec, parsed, tp=TpGroup(), pp_rank=0, recompute=recompute)
    shard = src / "model" / shard_name(tp_rank=0, pp_rank=0)
    stage.load_shard_state(load_shard(shard), str(shard))
    return stage


def saved_bytes_and_grads(stage: LlamaStage, ids: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward (outside recomputed regions), and the parameters' gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = stage(ids)
    logits.float().logsumexp(-1).sum().backward()
    return saved, {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_checkpointing_keeps_fewer_activations_and_equal_gradients(tmp_path, hf_model):
    """selective keeps less than none and full less again; the gradients are bitwise the same."""
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    results = {mode: saved_bytes_and_grads(loaded_stage(tmp_path, hf_model, mode), ids)
               for mode in ("none", "selective", "full")}
    saved = {mode: r[0] for mode, r in results.items()}
    assert saved["full"] < saved["selective"] < saved["none"], saved
    for mode in ("selective", "full"):
        assert all(torch.equal(results[mode][1][n], g) for n, g in results["none"][1].items()), mode


SPEC = ModelSpec(hidden=64, heads=8, kv_heads=8, head_dim=8, intermediate=96, vocab=128, layers=2, tied=False,
                 config={"hidden_size": 64, "num_attention_heads": 8})


@pytest.mark.parametrize("attention", ["separate", "coalesced", "qkv_linear"])
def test_attention_input_gradient_is_one_all_reduce(monkeypatch, attention):
    """At tp 2 the attention block all-reduces twice per forward+backward (o_proj out, the shared input's
    gradient), whatever the q/k/v layout: separate q/k/v used to all-reduce each projection's input gradient."""
    calls: list[tuple[int, ...]] = []

    def counting_all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        calls.append(tuple(t.shape))  # a one-rank "sum": the values stay as they are

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    layout = ParallelLayout(tp=2, attention=attention)
    tp = TpGroup(2, 0, group=object())
    attn = SelfAttention(SPEC, layout, tp, rank_heads(SPEC, layout, 0), dtype=torch.float32, carried_inv_freq=None)
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 4, 64, requires_grad=True)
    cos, sin = torch.ones(4, 8), torch.zeros(4, 8)
    attn(x, cos, sin).sum().backward()
    assert calls == [(2, 4, 64), (2, 4, 64)]
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_pp1_step_runs_each_microbatch_once(tmp_path, hf_model):
    """No shape-inference forward: a step of 2 microbatches calls the stage twice, and its gradient is the sum."""
    stage = loaded_stage(tmp_path, hf_model, "none")
    calls = []
    stage.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    step = PipelineStep(stage, pp_group=None, pp_size=1, microbatches=2, schedule="1f1b", tokens_per_batch=4 * 15,
                        device=torch.device("cpu"), mbs=2, seq_len=16)
    loss = step.run(ids)
    assert calls == [torch.Size([2, 16]), torch.Size([2, 16])]
    got = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad()
    logits = stage(ids)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6
    assert all((got[n] - p.grad).abs().max() <= 1e-6 for n, p in stage.named_parameters())


def test_exchanged_shapes_are_the_sequence_slices_with_sp():
    """What pipeline stages exchange: [mbs, seq/tp, hidden] with sequence parallelism, [mbs, seq, hidden] without."""
    layout = ParallelLayout(tp=2, pp=2, attention="qkv_linear")
    for sp, seq in ((False, 16), (True, 8)):
        first = LlamaStage(SPEC, layout, tp=TpGroup(2, 1, sequence_parallel=sp), pp_rank=0)
        last = LlamaStage(SPEC, layout, tp=TpGroup(2, 1, sequence_parallel=sp), pp_rank=1)
        assert exchanged_shapes(first, mbs=3, seq_len=16) == (((3, 16), torch.long), ((3, seq, 64), torch.float32))
        assert exchanged_shapes(last, mbs=3, seq_len=16) == (((3, seq, 64), torch.float32), ((3, 16, 64), torch.float32))

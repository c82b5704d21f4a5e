"""Distributed training equals transformers trained in one process on the same rows (fp32).

Every (tp, pp, dp) of the issue runs both models (GQA with kv_size_multiplier 2 where tp is 2,
and MHA), fused and unfused qkv_linear: 24 runs of 3 steps. Fused runs use plain SGD and 1F1B,
unfused runs AdamW and GPipe, so each combination sees both optimizers and both schedules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptconv.training.nxdtrain_format.state import MASTER, state_key
from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import run_world, train_options

COMBOS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]
LOSS_TOL = 1e-5
WEIGHT_TOL = {"sgd": 1e-6, "adamw": 1e-4}


def kvm(model: str, tp: int) -> int:
    return 2 if model == "gqa" and tp == 2 else 1


def assert_matches_reference(log: list[dict], export_dir: Path, ref: tuple[list[float], dict], optimizer: str, *,
                             loss_tol: float = LOSS_TOL, weight_tol: float | None = None) -> None:
    """Losses and exported weights equal the reference's within ``loss_tol`` and ``weight_tol`` (default: the
    optimizer's, fp32 on CPU)."""
    ref_losses, ref_state = ref
    losses = [row["loss"] for row in log]
    assert [row["step"] for row in log] == list(range(1, len(ref_losses) + 1))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= loss_tol, (losses, ref_losses)
    got = hf_state(export_dir)
    if "lm_head.weight" not in got:  # tied: HF's lm_head is the embedding
        assert ref_state["lm_head.weight"] is ref_state["model.embed_tokens.weight"] or torch.equal(
            ref_state["lm_head.weight"], ref_state["model.embed_tokens.weight"])
        ref_state = {k: v for k, v in ref_state.items() if k != "lm_head.weight"}
    assert set(got) == set(ref_state)
    worst = max((got[k] - ref_state[k]).abs().max().item() for k in got)
    assert worst <= (WEIGHT_TOL[optimizer] if weight_tol is None else weight_tol), \
        f"exported weights differ from the reference by {worst}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("model", ["gqa", "mha"])
@pytest.mark.parametrize("tp,pp,dp", COMBOS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in COMBOS])
def test_matches_transformers(tmp_path, nxd_model, reference, tp, pp, dp, model, fused):
    optimizer = "sgd" if fused else "adamw"
    # 2 microbatches per data-parallel rank: gradient accumulation, and enough for 1F1B over 2 stages
    options = train_options(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3, mbs=2 // dp)
    src = nxd_model(model, tp=tp, pp=pp, attention="qkv_linear", fuse_qkv=fused, kv_size_multiplier=kvm(model, tp))
    log = run_world(tp * pp * dp, resume=str(src), tp=tp, pp=pp, pp_schedule="1f1b" if fused else "gpipe",
                    checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"), **options)
    with warns_no_tokenizer():
        export(tmp_path / "ckpt", tmp_path / "hf")
    assert_matches_reference(log, tmp_path / "hf", reference(model, **options), optimizer)


# --------------------------------------------------------------------------------------------
# Other layouts, tied embeddings, ZeRO-1, bf16


VARIANTS = {
    # name: (model, tp, pp, dp, layout, optimizer)
    "gqa2-tp4-kvm2-trn1": ("gqa2", 4, 1, 1, dict(attention="qkv_linear", kv_size_multiplier=2, fuse_qkv=True), "adamw"),
    "gqa2-tp4-kvm2-trn2": ("gqa2", 4, 1, 1, dict(attention="qkv_linear", kv_size_multiplier=2, hw_backend="trn2"), "sgd"),
    "mha-separate-tp2-dp2": ("mha", 2, 1, 2, dict(attention="separate"), "sgd"),
    "mha-coalesced-tp2-pp2": ("mha", 2, 2, 1, dict(attention="coalesced"), "adamw"),
    "tied-tp2-pp2": ("tied", 2, 2, 1, dict(attention="qkv_linear", fuse_qkv=True), "sgd"),
    "tied-tp1-pp1": ("tied", 1, 1, 1, dict(attention="separate"), "adamw"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_other_layouts_match_transformers(tmp_path, nxd_model, reference, name):
    model, tp, pp, dp, layout, optimizer = VARIANTS[name]
    options = train_options(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3, mbs=2 if dp == 1 else 1)
    src = nxd_model(model, tp=tp, pp=pp, **layout)
    log = run_world(tp * pp * dp, resume=str(src), tp=tp, pp=pp, checkpoint_dir=str(tmp_path / "ckpt"),
                    log_jsonl=str(tmp_path / "log.jsonl"), **options)
    with warns_no_tokenizer():
        export(tmp_path / "ckpt", tmp_path / "hf")
    assert_matches_reference(log, tmp_path / "hf", reference(model, **options), optimizer)
    if model == "tied":  # the last stage's lm_head copy stayed equal to the first stage's embedding
        for t in range(tp):
            first = torch.load(tmp_path / f"ckpt/step_3/model/dp_rank_00_tp_rank_0{t}_pp_rank_00.pt", weights_only=True)
            last = torch.load(tmp_path / f"ckpt/step_3/model/dp_rank_00_tp_rank_0{t}_pp_rank_0{pp - 1}.pt",
                              weights_only=True)
            assert torch.equal(first["model.embed_tokens.weight"], last["lm_head.weight"])


def train_with_and_without_zero1(tmp_path: Path, src: Path, options: dict) -> dict[bool, tuple[list, dict]]:
    """4 processes at tp 2 x dp 2 from ``src``, once with the AdamW state sharded over dp (``tmp_path/zero1``) and once
    without (``zero0``): each run's log and exported HF state, by ``zero1``."""
    runs = {}
    for zero1 in (False, True):
        run = tmp_path / f"zero{int(zero1)}"
        log = run_world(4, resume=str(src), tp=2, zero1=zero1, checkpoint_dir=str(run / "ckpt"),
                        log_jsonl=str(run / "log.jsonl"), **options)
        with warns_no_tokenizer():
            export(run / "ckpt", run / "hf")
        runs[zero1] = (log, hf_state(run / "hf"))
    return runs


def test_zero1_equals_plain_adamw(tmp_path, nxd_model, reference):
    """ZeRO-1 shards the AdamW state over dp; the trained weights are bitwise those of plain AdamW."""
    options = train_options(optimizer="adamw")
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", kv_size_multiplier=2)
    runs = train_with_and_without_zero1(tmp_path, src, options)
    (plain_log, plain), (zero_log, zero) = runs[False], runs[True]
    assert [r["loss"] for r in plain_log] == [r["loss"] for r in zero_log]
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    # ZeRO-1 writes one optimizer file per dp rank, plain AdamW only dp rank 0's.
    assert sorted(p.name for p in (tmp_path / "zero1/ckpt/step_3/optim").iterdir()) == [
        f"dp_rank_0{d}_tp_rank_0{t}_pp_rank_00.pt" for d in range(2) for t in range(2)]
    assert len(list((tmp_path / "zero0/ckpt/step_3/optim").iterdir())) == 2
    assert_matches_reference(zero_log, tmp_path / "zero1/hf", reference("gqa", **options), "adamw")


def test_bf16_trains_close_to_fp32(tmp_path, nxd_model, reference):
    """bf16 parameters, fp32 masters and optimizer state: losses within bf16 rounding of the fp32 reference."""
    options = train_options(optimizer="adamw")
    src = nxd_model("gqa", tp=2, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    log = run_world(4, resume=str(src), tp=2, pp=2, checkpoint_dir=str(tmp_path / "ckpt"),
                    log_jsonl=str(tmp_path / "log.jsonl"), **{**options, "precision": "bf16"})
    ref_losses, _ = reference("gqa", **options)
    assert max(abs(r["loss"] - ref) for r, ref in zip(log, ref_losses, strict=True)) < 3e-2
    tag = tmp_path / "ckpt/step_3"
    bf16_masters(tag, "dp_rank_00_tp_rank_01_pp_rank_01.pt")


def bf16_masters(tag: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A bf16 run's shard ``name`` of ``tag``: its fp32 masters, checked to round to the bf16 weights, and its
    optimizer file."""
    shard = torch.load(tag / "model" / name, weights_only=True)
    optim = torch.load(tag / "optim" / name, weights_only=True)
    assert {t.dtype for t in shard.values()} == {torch.bfloat16}
    masters = {k: optim[state_key(k, MASTER)] for k in shard}
    assert {t.dtype for t in masters.values()} == {torch.float32}
    assert all(torch.equal(masters[k].to(torch.bfloat16), shard[k].contiguous()) for k in shard)
    return masters, optim

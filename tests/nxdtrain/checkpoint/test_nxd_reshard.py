"""``ckptconv reshard`` of NxD's own training tags (fixtures/nxdt-official/, written by NxD 2.28): an nxdtrain
training tag (format 2) with NxD's optimizer state, step and schedule, checked as tests/nxdtrain/checkpoint/test_nxd_resume.py
checks a direct resume: each rank of the resharded tag continues step 3 with the recorded gradients to NxD's own
step 3 (within an fp32 ulp; a fresh optimizer is off by about 1e-3 there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.commands.api import reshard, to_hf
from ckptconv.commands.dcp import to_dcp
from ckptconv.core.layout import ParallelLayout
from ckptconv.training import lr_at
from ckptconv.training.nxdtrain_format.state import is_training_tag
from nxdtrain.checkpoint.resume import read_training_state, resolve_resume
from nxdtrain.config.options import OptimConfig
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.checkpoint.test_nxd_resume import (
    CASES,
    FP32_STATE,
    SCHEDULE,
    manifest,
    nxd_tag,
    reference,
    step_3_at,
    step_lr,
)
from tests.training.nxd_format.test_read import MASTER_CASES, QUIET, expected_model_weights, masters_only

TP1 = ParallelLayout(tp=1, pp=1, attention="qkv_linear", fuse_qkv=True)
TP2 = ParallelLayout(tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)


def resharded(case: str, tmp: Path) -> tuple[Path, Path, Path]:
    """(NxD's tag, it resharded to tp 2, that back to tp 1): both nxdtrain training tags."""
    nxds = nxd_tag(case, tmp / "nxd")
    tp2 = reshard(nxds, tmp / "tp2", tp=2, pp=1).out
    back = reshard(tp2, tmp / "tp1", tp=1, pp=1).out
    assert is_training_tag(tp2) and is_training_tag(back)
    return nxds, tp2, back


@pytest.mark.parametrize("case", FP32_STATE)
def test_reshard_of_nxds_tag_continues_step_3_as_nxd_did(case: str, tmp_path: Path) -> None:
    nxds, tp2, back = resharded(case, tmp_path)
    assert not resolve_resume(str(tp2), weights_only=False).nxd  # nxdtrain's own format now
    for tag in (tp2, back):
        state = read_training_state(tag, None, gbs=4)
        assert state.step == manifest(case)["saved_after_step"]
        if "schedule" in state.run:  # the schedule as nxdtrain reads it gives NxD's step-3 lr
            cfg = OptimConfig(lr=state.run["lr"], min_lr=state.run["min_lr"], warmup=state.run["warmup"],
                              schedule=state.run["schedule"])
            assert lr_at(state.step + 1, cfg, decay_steps=state.run["decay_steps"]) == pytest.approx(
                step_lr(case, nxds), rel=1e-12)
    step_3_at(case, nxds, tp2, TP2, tmp_path / "at_tp2")
    step_3_at(case, nxds, back, TP1, tmp_path / "at_tp1")


def test_reshard_over_dp_2_with_zero1_continues_step_3(tmp_path: Path) -> None:
    """NxD's ZeRO-1 state re-partitioned over 2 dp ranks (nxdtrain's partition): the same step 3."""
    case = "zero1_fp32"
    nxds = nxd_tag(case, tmp_path / "nxd")
    out = reshard(nxds, tmp_path / "dp2", tp=2, pp=1, dp=2, zero1=True).out
    assert sorted(p.name for p in (out / "optim").iterdir()) == [
        f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(2) for t in range(2)]
    step_3_at(case, nxds, out, TP2, tmp_path / "at_tp2")


def test_the_position_is_carried_and_said(tmp_path: Path) -> None:
    """The NxDT tag's consumed samples (its name) and NxD's example's (none: step x --gbs at resume)."""
    nxdt = reshard(nxd_tag("nxdt_zero1_bf16_masters_xser", tmp_path / "a"), tmp_path / "a_out", tp=2, pp=1)
    assert read_training_state(nxdt.out, None).consumed_samples == 8
    example = reshard(nxd_tag("plain_fp32", tmp_path / "b"), tmp_path / "b_out", tp=2, pp=1)
    assert any("NxD's own training tag mapped to nxdtrain's format 2: training tag at step 2" in n
               for n in example.notes)
    assert any("records no consumed samples" in n for n in example.notes)
    state = read_training_state(example.out, None, gbs=4)
    assert state.consumed_samples == 8 and "step 2 x --gbs 4" in state.notes[0]
    titan = to_dcp(example.out, tmp_path / "dcp")  # the unrecorded position stays unrecorded on the way on
    assert any("the data loader position (the tag records no consumed samples" in n for n in titan.notes)


def _resumed_run(tag: Path, log: Path, *layout: str) -> tuple[str, list[dict[str, Any]]]:
    """``nxdtrain run --resume TAG`` for steps 3-4 over 2 processes at ``layout``: what it said, and its log rows."""
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(tag), "--steps", "4", "--data",
            "synthetic", "--seq-len", "16", "--gbs", "4", "--mbs", "1", "--log-jsonl", str(log),
            "--no-checkpoint", *SCHEDULE, "--precision", "fp32", *layout, "--nproc", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr, [json.loads(line) for line in log.read_text().splitlines()]


def test_run_resumes_the_resharded_tag(tmp_path: Path) -> None:
    """``nxdtrain run --resume`` of the resharded tag at its tp 2: steps 3 and 4 with the losses of a direct
    resume of NxD's tag at tp 2 (the same state read two ways)."""
    nxds = nxd_tag("zero1_bf16_masters_only_xser", tmp_path / "nxd")
    out = reshard(nxds, tmp_path / "tp2", tp=2, pp=1).out
    logs = []
    for k, tag in enumerate((nxds, out)):
        said, log = _resumed_run(tag, tmp_path / f"run{k}.jsonl", "--tp", "2")
        if k == 1:
            assert "the data continues at sample 8 = step 2 x --gbs 4" in said
        logs.append(log)
    assert [r["step"] for r in logs[1]] == [3, 4]
    for one, two in zip(*logs, strict=True):
        assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)
        assert one["consumed_samples"] == two["consumed_samples"]


def test_the_position_module_examples() -> None:
    """ckptconv.training.nxd_format.position's docstring example (the mapping nxdtrain's resume of NxD's tag used to hold)."""
    import doctest

    import ckptconv.training.nxd_format.position

    result = doctest.testmod(ckptconv.training.nxd_format.position)
    assert result.attempted > 0 and result.failed == 0


def test_reshard_of_bf16_moments_continues_step_3(tmp_path: Path) -> None:
    """plain_bf16 (bf16 weights and bf16 AdamW moments, no masters) resharded at its own layout (tp 1), to tp 2
    and back to tp 1: each rank's step 3 is within 4 bf16 ulps of NxD's own and bit for bit nxdtrain's
    direct resume of NxD's tag (see step_3_at)."""
    nxds, tp2, back = resharded("plain_bf16", tmp_path)
    same = reshard(nxds, tmp_path / "same", tp=1, pp=1).out
    assert is_training_tag(same)
    for tag, run in ((same, TP1), (tp2, TP2), (back, TP1)):
        step_3_at("plain_bf16", nxds, tag, run, tmp_path / f"at_{tag.name}")


# NxD's tag (tp 1 pp 1, 2 layers) to pipeline layouts: tp 2 x pp 2, and 2 virtual stages (pp 1 x vpp 2: the model's
# 2 layers allow no pp 2 x vpp 2); nxdtrain runs no vpp, so that tag is resumed at pp 2 (resharded on load)
PIPELINES = [(dict(tp=2, pp=2), ParallelLayout(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)),
             (dict(tp=1, pp=1, vpp=2), ParallelLayout(tp=1, pp=2, attention="qkv_linear", fuse_qkv=True))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("layout", "run"), PIPELINES, ids=["tp2-pp2", "vpp2"])
def test_reshard_to_pipeline_stages_exports_and_continues_as_nxd(case: str, layout: dict[str, int],
                                                                 run: ParallelLayout, tmp_path: Path) -> None:
    """The resharded tag's to-hf gives exactly the weights NxD saved (its model files' values; with
    ``--masters`` NxD's fp32 masters, where it saved them), and every (tp, pp) rank resumed from it continues
    step 3 as NxD did (:func:`step_3_at`)."""
    nxds = nxd_tag(case, tmp_path / "nxd")
    out = reshard(nxds, tmp_path / "out", **layout, options=QUIET).out
    assert is_training_tag(out)
    held = reference(case, "params_at_save.hf")
    shards = not masters_only(case)
    with warns_no_tokenizer():
        to_hf(out, tmp_path / "hf", dtype="keep", masters=None if masters_only(case) else False, options=QUIET)
    got = hf_state(tmp_path / "hf")
    assert sorted(got) == sorted(held)
    for name, value in got.items():
        want = expected_model_weights(case, value, name) if shards else held[name]
        assert value.dtype == want.dtype and torch.equal(value, want), name
    if case in MASTER_CASES:
        with warns_no_tokenizer():
            to_hf(out, tmp_path / "hf-masters", dtype="keep", masters=True, options=QUIET)
        got = hf_state(tmp_path / "hf-masters")
        assert sorted(got) == sorted(held)
        assert all(v.dtype == held[k].dtype and torch.equal(v, held[k]) for k, v in got.items())
    step_3_at(case, nxds, out, run, tmp_path / "step3")


def test_run_resumes_pipeline_tags(tmp_path: Path) -> None:
    """``nxdtrain run --resume`` at pp 2 of NxD's tag itself, of it resharded to tp 2 x pp 2 and of it resharded to
    2 virtual stages (nxdtrain runs no vpp: resharded on load): steps 3 and 4 with the same losses."""
    nxds = nxd_tag("zero1_bf16_masters_only_xser", tmp_path / "nxd")
    tags = [nxds] + [reshard(nxds, tmp_path / name, **layout, options=QUIET).out
                     for name, (layout, _) in zip(("tp2pp2", "vpp2"), PIPELINES, strict=True)]
    logs = []
    for k, tag in enumerate(tags):
        # --tp 1 given: a degree not given is now the shards' (tp 2 for the tp2pp2 tag)
        said, log = _resumed_run(tag, tmp_path / f"run{k}.jsonl", "--tp", "1", "--pp", "2")
        if k == 2:
            assert "resharding on load" in said and "vpp 2" in said
        logs.append(log)
    assert [r["step"] for r in logs[0]] == [3, 4]
    for other in logs[1:]:
        for one, two in zip(logs[0], other, strict=True):
            assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)
            assert one["consumed_samples"] == two["consumed_samples"]


@pytest.mark.parametrize("case", ["zero1_bf16_masters_only_xser", "zero1_downcast_fp64_masters"])
def test_the_resharded_tag_resumes_as_nxds_tag_does(case: str, tmp_path: Path) -> None:
    """NxD's bf16 tags with masters (a masters-only xser tag; XLA_DOWNCAST_BF16's fp64 masters) resumed directly
    and after ``ckptconv reshard`` at the same layout: each path in the precision it records (bf16: NxD's model
    files declare bf16 weights; every reshard of NxD's tag recorded fp32, so its run trained in fp32), then step 3
    with the recorded gradients: the same model dtype and the same fp32 masters, bit for bit."""
    from nxdtrain.checkpoint.nxd_resume import read_nxd_state
    from tests.nxdtrain.checkpoint.test_nxd_resume import restored

    nxds = nxd_tag(case, tmp_path / "nxd")
    out = reshard(nxds, tmp_path / "same", tp=1, pp=1).out
    precisions = [read_nxd_state(nxds, None, gbs=4)[0].options["precision"],
                  read_training_state(out, None, gbs=4).options["precision"]]
    assert precisions == ["bf16", "bf16"]
    grads, lr = reference(case, "grads_next.nxd"), step_lr(case, nxds)
    after = []
    for tag, precision in zip((nxds, out), precisions, strict=True):
        optimizer = restored(tag, TP1, 0, torch.bfloat16 if precision == "bf16" else torch.float32)
        for name in optimizer.names:
            optimizer.master[name].grad = grads[name].to(torch.float32)
        optimizer.step(lr)
        after.append({name: optimizer.master[name].detach() for name in optimizer.names})
    direct, again = after
    assert sorted(direct) == sorted(again)
    for name, value in direct.items():
        assert value.dtype == again[name].dtype == torch.float32 and torch.equal(value, again[name]), name


@pytest.mark.parametrize("case", ["zero1_bf16_masters_only_xser", "plain_fp32"])
def test_reshard_parses_nxds_optimizer_once(case: str, tmp_path: Path, nxd_optimizers_made: list[Path]) -> None:
    """The weights' look at NxD's optimizer (its masters, or the note that they exist) and the state the reshard
    moves share one parse of NxD's optimizer files (two before); the tag still continues step 3 as NxD did."""
    nxds = nxd_tag(case, tmp_path / "nxd")
    out = reshard(nxds, tmp_path / "tp2", tp=2, pp=1).out
    assert nxd_optimizers_made == [nxds]
    step_3_at(case, nxds, out, TP2, tmp_path / "at_tp2")

"""``nxdtrain run --optimizer-format nxd`` of an MoE model at ep 2 with ZeRO-1 (issue 30 follow-up): each save is
rewritten in NxD's expert-parallel ZeRO-1 files (NeuronEPZero1Optimizer's, ckptconv.training.nxd_format.write_ep);
ckptconv reads them back equal to the state the run saved in nxdtrain's own format, and a resume from the NxD-format
tag continues with the uninterrupted run's losses (1e-5). What NxD's EP files cannot hold is refused before any
process: ZeRO-1 off, a bf16 run's fp32 masters."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptconv
from nxdtrain.config.options import NXD_SCHEDULE, TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.moe_tags import all_state
from tests.nxdtrain.harness import convert, run_world, train_options
from tests.nxdtrain.moe_reference import make_moe

TOL = 1e-5
WORLD = 4  # dp 4 = ep 2 x expert-data-parallel 2: each ep rank's experts' state ZeRO-1-sharded over 2 ranks


def _options(**extra):
    return train_options(**{**dict(optimizer="adamw", lr=1e-3, gbs=4, mbs=1, seq_len=16, steps=3, decay_steps=3,
                                   schedule=NXD_SCHEDULE, ep=2, zero1=True, checkpoint_freq=1, keep=3), **extra})


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-nxd-optim")
    return convert(make_moe(root / "hf", "mixtral"), root / "nxd")


def test_ep2_zero1_saves_nxds_ep_files_that_read_back_and_resume(tmp_path, mixtral):
    ours = run_world(WORLD, resume=str(mixtral), checkpoint_dir=str(tmp_path / "ours"),
                     log_jsonl=str(tmp_path / "ours.jsonl"), **_options())
    log = run_world(WORLD, resume=str(mixtral), checkpoint_dir=str(tmp_path / "nxd"),
                    log_jsonl=str(tmp_path / "nxd.jsonl"), **_options(optimizer_format="nxd"))
    assert [r["loss"] for r in log] == [r["loss"] for r in ours]  # saving in NxD's format changes no step
    tag = tmp_path / "nxd" / "step_1"
    names = sorted(p.name for p in (tag / "optim").iterdir())
    assert names == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(WORLD)]  # NxD's: no ep in the name
    # ckptconv reads NxD's files back (into nxdtrain's format at the same layout): the run's own saved state
    back = ckptconv.reshard(tag, tmp_path / "back", ep=2, dp=WORLD, zero1=True,
                            options=ckptconv.RunOptions(quiet=True)).out
    got, want = all_state(back), all_state(tmp_path / "ours" / "step_1")
    assert set(got) == set(want) and any("expert_mlps" in key for _, key in want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= TOL
    resumed = run_world(WORLD, resume=str(tag), checkpoint_dir=str(tmp_path / "resumed"),
                        log_jsonl=str(tmp_path / "resumed.jsonl"), **_options(optimizer_format="nxd"))
    assert [r["step"] for r in resumed] == [2, 3]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, ours[1:], strict=True)) <= TOL


@pytest.mark.parametrize(("extra", "message"), [
    (dict(zero1=False), r"--optimizer-format nxd with --ep 2 needs --zero1: NxD's expert-parallel optimizer files "
                        r"are its ZeRO-1 optimizer's \(NeuronEPZero1Optimizer\), the only ones ckptconv writes at "
                        r"ep > 1"),
    (dict(precision="bf16"), r"--optimizer-format nxd with --ep 2 and --precision bf16: NxD's expert-parallel ZeRO-1 "
                             r"files hold no fp32 masters, so each save would lose them; use --precision fp32 or "
                             r"--optimizer-format nxdtrain"),
], ids=["zero1-off", "bf16-masters"])
def test_what_nxds_ep_files_cannot_hold_is_refused_before_any_process(tmp_path, mixtral, extra, message):
    config = TrainConfig.from_flat({**_options(optimizer_format="nxd", **extra), "resume": str(mixtral),
                                    "checkpoint_dir": str(tmp_path / "ck")})
    with pytest.raises(TrainError, match=f"^{message}$"):
        prepare(config, WORLD)

"""An MoE training tag at ep 2 (issue 30): resumes at ep 1 and back at ep 2 to the run that never stopped (AdamW
moments carried with each expert), directly and after a ``ckptconv reshard`` of the tag to another ep; the tag's
files are NxD's ep layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptconv
from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import convert, run_world, train_options
from tests.nxdtrain.moe_reference import make_moe

TOL = 1e-5


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-resume")
    return convert(make_moe(root / "hf", "mixtral"), root / "nxd")


def _options(**extra):
    # 2 processes: dp 2, which ep 2 splits into two ep ranks; 2 micro-batches per dp rank
    return train_options(**{**dict(optimizer="adamw", lr=1e-3, gbs=4, mbs=1, seq_len=16, steps=3, decay_steps=3),
                            **extra})


def _exported(tag: Path, out: Path) -> dict[str, torch.Tensor]:
    with warns_no_tokenizer():
        export(tag, out)
    return hf_state(out)


def _assert_same(log, straight, got, want) -> None:
    assert [r["step"] for r in log] == [1, 2, 3]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(log, straight, strict=True)) <= TOL, (log, straight)
    assert max(abs(a["aux_loss"] - b["aux_loss"]) for a, b in zip(log, straight, strict=True)) <= TOL
    assert set(got) == set(want)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("zero1", [False, True], ids=["dp2", "dp4-zero1"])
def test_resume_ep2_ep1_ep2_equals_the_uninterrupted_run(tmp_path, mixtral, zero1):
    """dp 2, or dp 4 with ZeRO-1 (each ep rank's experts' state over its 2 expert-data-parallel ranks)."""
    world, extra = (4, dict(zero1=True, mbs=1)) if zero1 else (2, {})
    straight = run_world(world, resume=str(mixtral), ep=2, checkpoint_dir=str(tmp_path / "a"),
                         log_jsonl=str(tmp_path / "a.jsonl"), **_options(**extra))
    root = tmp_path / "b"
    log = run_world(world, resume=str(mixtral), ep=2, checkpoint_dir=str(root), log_jsonl=str(tmp_path / "b1.jsonl"),
                    **_options(steps=1, **extra))
    files = set(json.loads((root / "step_1/ckptconv.json").read_text())["files"])
    assert {"model/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt",
            *(f"optim/dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(world if zero1 else 2))} <= files
    log += run_world(world, resume=str(root), ep=1, checkpoint_dir=str(root), log_jsonl=str(tmp_path / "b2.jsonl"),
                     **_options(steps=2, **extra))
    log += run_world(world, resume=str(root), ep=2, checkpoint_dir=str(root), log_jsonl=str(tmp_path / "b3.jsonl"),
                     **_options(**extra))
    _assert_same(log, straight, _exported(root, tmp_path / "hf-b"), _exported(tmp_path / "a", tmp_path / "hf-a"))


@pytest.mark.slow
def test_a_tag_resharded_to_another_ep_resumes_the_same(tmp_path, mixtral):
    straight = run_world(2, resume=str(mixtral), ep=2, checkpoint_dir=str(tmp_path / "a"),
                         log_jsonl=str(tmp_path / "a.jsonl"), **_options())
    log = run_world(2, resume=str(mixtral), ep=2, checkpoint_dir=str(tmp_path / "b"),
                    log_jsonl=str(tmp_path / "b1.jsonl"), **_options(steps=1))
    ckptconv.reshard(tmp_path / "b/step_1", tmp_path / "c/step_1", ep=1, options=ckptconv.RunOptions(quiet=True))
    log += run_world(2, resume=str(tmp_path / "c/step_1"), ep=1, checkpoint_dir=str(tmp_path / "d"),
                     log_jsonl=str(tmp_path / "b2.jsonl"), **_options())
    _assert_same(log, straight, _exported(tmp_path / "d", tmp_path / "hf-d"),
                 _exported(tmp_path / "a", tmp_path / "hf-a"))

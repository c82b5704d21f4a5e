"""``nxdtrain run --optimizer-format nxd``: every save in NxD's own optimizer format, resumed with the full state.

4 AdamW steps saved at step 2 in NxD's format; steps 3-4 continued from that tag (at the same layout and at
another one, read back through nxdtrain's resume of NxD's tags) give the uninterrupted run's losses within
1e-5, and a run saved in nxdtrain's own format gives the same losses (saving in NxD's format changes nothing
of the training). The files are NxD's structures (``torch.load(weights_only=True)``); a fresh optimizer at step
3 would not give these losses (the moments move every weight by about the learning rate).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.commands.api import RunOptions, reshard
from ckptconv.errors import ConversionError
from ckptconv.training.nxd_format.read import NxdOptimizer
from nxdtrain.checkpoint.resume import resolve_resume, resolve_start
from nxdtrain.config.options import CheckpointConfig, TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.nxdtrain.harness import run_world, train_options

TOL = 1e-5
SOURCE = dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)
SCHEDULER_KEYS = ["max_steps", "warmup_steps", "constant_steps", "decay_steps", "min_lr", "base_lrs", "last_epoch",
                  "_step_count", "_is_initial", "_get_lr_called_within_step", "_last_lr"]


def _options(**overrides: Any) -> dict[str, Any]:
    return train_options(**{**dict(optimizer="adamw", steps=4, decay_steps=4, warmup=2, gbs=4, mbs=1,
                                   checkpoint_freq=2, keep=2, schedule="CosineAnnealing", optimizer_format="nxd"),
                            **overrides})


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, nxd_model: Any) -> dict[str, Any]:
    """Uninterrupted at tp 2 x pp 2 (fp32, ZeRO-1 off) saving in NxD's format, and the same in nxdtrain's."""
    root = tmp_path_factory.mktemp("nxd-format")
    src = nxd_model("gqa2-4", **SOURCE)
    options = _options(precision="fp32")
    log = run_world(4, resume=str(src), checkpoint_dir=str(root / "ckpt"), log_jsonl=str(root / "log.jsonl"),
                    tp=2, pp=2, **options)
    ours = run_world(4, resume=str(src), checkpoint_dir=str(root / "ours"), log_jsonl=str(root / "ours.jsonl"),
                     tp=2, pp=2, **{**options, "optimizer_format": "nxdtrain"})
    return {"log": log, "ours": ours, "tag": root / "ckpt/step_2", "options": options, "root": root}


def _continue(straight: dict[str, Any], tmp: Path, resume: Path, nproc: int, want: list[dict[str, Any]],
              **layout: Any) -> list[dict[str, Any]]:
    log = run_world(nproc, resume=str(resume), checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"),
                    **{**straight["options"], **layout})
    assert [r["step"] for r in log] == [3, 4]
    for mine, theirs in zip(log, want, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)
        assert mine["lr"] == theirs["lr"]
    return log


def test_saved_in_nxds_format(straight: dict[str, Any]) -> None:
    """NxD's structures in every file; the losses are those of the run saving in nxdtrain's format."""
    assert [r["loss"] for r in straight["log"]] == [r["loss"] for r in straight["ours"]]
    tag = straight["tag"]
    for tp in range(2):
        for pp in range(2):
            saved = torch.load(tag / f"optim/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt", weights_only=True)
            assert list(saved) == ["state", "param_groups"]  # dp 1: torch AdamW's state dict
            assert sorted(saved["state"]) == list(range(sum(len(g["params"]) for g in saved["param_groups"])))
            assert all(list(s) == ["step", "exp_avg", "exp_avg_sq"] for s in saved["state"].values())
    assert list(torch.load(tag / "scheduler.pt", weights_only=True)) == SCHEDULER_KEYS
    user = torch.load(tag / "user_content.pt", weights_only=True)
    assert list(user)[:4] == ["total_steps", "batch_idx", "epoch", "cli_args"] and user["total_steps"] == 2
    assert user["nxdtrain"]["user_content"]["consumed_samples"] == 8
    with NxdOptimizer.open(tag) as optim:  # NxD's reader names every index (Llama example's groups)
        assert optim.naming() == "names containing 'bias' or 'norm' in the no-decay group" and optim.step() == 2
    meta = json.loads((tag / "ckptconv.json").read_text())
    assert meta["extra"]["nxd_optimizer"]["param_groups"] == "bias-norm" and meta["extra"]["nxdtrain"]["run"]
    assert sorted(p.name for p in straight["root"].joinpath("ckpt").iterdir()) == ["step_2", "step_4"]


def test_resumed_at_the_same_layout(straight: dict[str, Any], tmp_path: Path) -> None:
    _continue(straight, tmp_path, straight["tag"], 4, straight["log"][2:], tp=2, pp=2)


def test_resumed_at_tp1_pp1(straight: dict[str, Any], tmp_path: Path) -> None:
    _continue(straight, tmp_path, straight["tag"], 1, straight["log"][2:], tp=1, pp=1)


def test_resume_names_who_wrote_the_nxd_format(straight: dict[str, Any]) -> None:
    """Our NxD-format tag is not announced as NxD's own (its ckptconv.json records the NxD-format write)."""
    case = resolve_resume(str(straight["tag"]), weights_only=False).case
    assert "in NxD's optimizer format written by ckptconv/nxdtrain" in case and "NxD's own code" not in case


def test_a_stop_between_the_renames_of_a_rewrite_is_finished(straight: dict[str, Any], tmp_path: Path) -> None:
    """A stop after step_4 was moved aside and before its complete rewrite took its place: --resume auto puts the
    rewrite in place (and says so) instead of going back to step_2; a rewrite without 'done' is left alone."""
    root = tmp_path / "ckpt"
    shutil.copytree(straight["root"] / "ckpt", root)
    os.rename(root / "step_4", root / ".step_4.nxd-format")
    shutil.copytree(root / ".step_4.nxd-format", root / ".step_4.format2")  # the replaced tag, same run
    (root / ".step_4.format2" / "notes.txt").write_text("not nxdtrain's")
    source = resolve_start(CheckpointConfig(resume="auto", checkpoint_dir=str(root)))
    assert source.root == root / "step_4" and "put in place its complete NxD-format rewrite" in source.case
    assert sorted(p.name for p in (root / ".step_4.format2").iterdir()) == ["notes.txt"]  # only what we wrote went
    os.rename(root / "step_4", root / ".step_4.nxd-format")
    (root / ".step_4.nxd-format" / "done").unlink()  # incomplete: never put in place
    source = resolve_start(CheckpointConfig(resume="auto", checkpoint_dir=str(root)))
    assert source.root == root / "step_2" and (root / ".step_4.nxd-format").is_dir()


def test_bf16_zero1_dp2(nxd_model: Any, tmp_path: Path) -> None:
    """bf16 with fp32 masters: ZeRO-1 over dp 2 in NxD's format (chunks of every parameter on both dp ranks,
    the masters in sharded_master_weights), resumed at dp 2 and, re-cut, at dp 1."""
    src = nxd_model("gqa2-4", tp=1, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)
    options = _options(precision="bf16", zero1=True)
    straight = {"options": options}
    log = run_world(2, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
                    tp=1, pp=1, **options)
    tag = tmp_path / "ckpt/step_2"
    files = sorted(p.name for p in (tag / "optim").iterdir())
    assert files == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    first = torch.load(tag / "optim" / files[0], weights_only=True)
    assert list(first) == ["state", "param_groups", "base_state", "shape_info", "sharded_master_weights"]
    assert all(m.dtype == torch.float32 for m in first["sharded_master_weights"].values())
    _continue(straight, tmp_path / "dp2", tag, 2, log[2:], tp=1, pp=1, zero1=True)
    _continue(straight, tmp_path / "dp1", tag, 1, log[2:], tp=1, pp=1, zero1=True)


def test_refused_before_training(nxd_model: Any, tmp_path: Path) -> None:
    """What NxD's format cannot hold is refused before the first step, naming the flag."""
    src = str(nxd_model("gqa2-4", tp=1, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1))
    base = {**_options(precision="fp32"), "resume": src, "checkpoint_dir": str(tmp_path / "c")}
    with pytest.raises(TrainError, match="needs --schedule CosineAnnealing .* got --schedule cosine"):
        TrainConfig.from_flat({**base, "schedule": "cosine"})
    with pytest.raises(TrainError, match="needs --optimizer adamw"):
        TrainConfig.from_flat({**base, "optimizer": "sgd"})
    with pytest.raises(TrainError, match="--nxd-param-groups one applies to --optimizer-format nxd only"):
        TrainConfig.from_flat({**base, "optimizer_format": "nxdtrain", "nxd_param_groups": "one"})
    with pytest.raises(TrainError, match="with --precision bf16 needs --zero1"):
        prepare(TrainConfig.from_flat({**base, "precision": "bf16"}), world_size=1)
    with pytest.raises(TrainError, match=r"needs --zero1 \(with --shard-params, which replaces --zero1: "
                                         r"--optimizer-format nxdtrain\)"):  # the way out when --zero1 is refused
        prepare(TrainConfig.from_flat({**base, "precision": "bf16", "shard_params": True}), world_size=2)


def test_reshard_of_our_tag(nxd_model: Any, tmp_path: Path) -> None:
    """``ckptconv reshard --optimizer-format nxd`` of nxdtrain's own tag: another schedule than NxD's
    CosineAnnealing is refused naming it; without weight decay every rule works (recorded, read back)."""
    src = nxd_model("gqa2-4", tp=1, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)
    run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "cos"), log_jsonl=str(tmp_path / "a.jsonl"), tp=1,
              pp=1, **_options(precision="fp32", schedule="cosine", optimizer_format="nxdtrain", steps=2))
    with pytest.raises(ConversionError, match="schedule 'cosine': NxD's examples have no such scheduler"):
        reshard(tmp_path / "cos/step_2", tmp_path / "x", tp=1, pp=1, optimizer_format="nxd",
                options=RunOptions(quiet=True))
    run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "wd0"), log_jsonl=str(tmp_path / "b.jsonl"), tp=1,
              pp=1, **_options(precision="fp32", optimizer_format="nxdtrain", steps=2, weight_decay=0.0))
    for rule, naming in (("one", "one param group, model order"),
                         ("bias-LayerNorm", "names containing 'bias' or 'LayerNorm' in the no-decay group")):
        out = tmp_path / rule
        reshard(tmp_path / "wd0/step_2", out, tp=1, pp=1, optimizer_format="nxd", nxd_param_groups=rule,
                options=RunOptions(quiet=True))
        with NxdOptimizer.open(out) as optim:
            assert optim.naming() == naming
        assert json.loads((out / "ckptconv.json").read_text())["extra"]["nxd_optimizer"]["param_groups"] == rule


def test_retention_counts_nxd_format_tags(nxd_model: Any, tmp_path: Path) -> None:
    """--keep 1 deletes the older tags written in NxD's format (their ckptconv.json keeps the run's id), and the
    rewrite leaves nothing beside the tags (its staging and the replaced tag are gone)."""
    src = nxd_model("gqa2-4", tp=1, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)
    run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
              tp=1, pp=1, **_options(precision="fp32", steps=3, checkpoint_freq=1, keep=1))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_3"]
    assert (tmp_path / "ckpt/step_3/done").is_file()
    assert "nxd_optimizer" in json.loads((tmp_path / "ckpt/step_3/ckptconv.json").read_text())["extra"]

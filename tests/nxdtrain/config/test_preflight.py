"""Runs that would silently waste time are refused or announced before the first step."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ckptconv.io.digest import record_files
from ckptconv.io.metadata import read_metadata, write_metadata
from ckptconv.io.tags import write_markers
from ckptconv.training import lr_at
from nxdtrain.cli import main
from nxdtrain.config import preflight
from nxdtrain.config.options import TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.nxdtrain.harness import train_options

NXDTRAIN = [sys.executable, "-m", "nxdtrain.cli"]


def nxdtrain(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NXDTRAIN, *argv], capture_output=True, text=True, timeout=240)


@pytest.fixture
def src(nxd_model):
    return nxd_model("mha", tp=1, pp=1, attention="separate")


def config(**options) -> TrainConfig:
    return TrainConfig.from_flat(train_options(**options))


def test_a_run_that_saves_nothing_needs_no_checkpoint(src, tmp_path):
    with pytest.raises(TrainError) as info:
        prepare(config(resume=str(src)), world_size=1)
    assert str(info.value) == ("no --checkpoint-dir: this run would save nothing and its trained weights would be lost; "
                               "pass --checkpoint-dir DIR, or --no-checkpoint to train without saving")
    assert prepare(config(resume=str(src), no_checkpoint=True), world_size=1).dp == 1
    with pytest.raises(TrainError, match=r"^--no-checkpoint and --checkpoint-dir ck exclude each other; choose one$"):
        config(resume=str(src), no_checkpoint=True, checkpoint_dir="ck")


def test_synthetic_notice_once_and_steps_1_trains_at_nonzero_lr(src, tmp_path):
    """Two ranks, one notice (rank 0's); one step at the default min lr, 0.1 x lr, not 0."""
    log = tmp_path / "log.jsonl"
    run = nxdtrain("run", "--nproc", "2", "--resume", str(src), "--data", "synthetic", "--steps", "1", "--seq-len", "16",
                   "--gbs", "2",
                   "--precision", "fp32", "--no-checkpoint", "--log-jsonl", str(log), "--lr", "1e-3")
    assert run.returncode == 0, run.stderr
    notice = ("nxdtrain: training on synthetic data: --data synthetic, so the rows are random tokens from --seed, "
              "not a corpus; pass --data PATH to train on your data")
    assert run.stderr.splitlines().count(notice) == 1
    assert preflight.synthetic_notice(config(resume=str(src), data=str(tmp_path / "rows.jsonl"))) is None
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["step"] == 1 and record["lr"] == pytest.approx(1e-4, rel=1e-12)


def test_min_lr_default_and_schedule_table():
    cfg = TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 1.0, "warmup": 1, "steps": 4, "schedule": "cosine"})
    assert cfg.optim.min_lr == 0.1
    # warmup 1, then cosine from 1.0 to 0.1 over steps 2..4: 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2, k = 1, 2, 3
    assert [lr_at(s, cfg.optim, decay_steps=cfg.decay_steps) for s in range(1, 5)] == pytest.approx(
        [1.0, 0.775, 0.325, 0.1], abs=1e-12)
    one = TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 3e-4, "steps": 1})
    assert lr_at(1, one.optim, decay_steps=one.decay_steps) == pytest.approx(3e-5, rel=1e-12)
    linear = TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 2.0, "steps": 4, "schedule": "linear"})
    assert [lr_at(s, linear.optim, decay_steps=4) for s in range(1, 5)] == pytest.approx([1.55, 1.1, 0.65, 0.2])
    # Asked for: --min-lr 0 ends at 0; an explicit value is kept; YAML (NxDT min_lr) the same way.
    zero = TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 1.0, "min_lr": 0.0, "steps": 2, "schedule": "linear"})
    assert [lr_at(s, zero.optim, decay_steps=2) for s in (1, 2)] == [0.5, 0.0]
    assert TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 1.0, "min_lr": 0.3}).optim.min_lr == 0.3
    assert math.isclose(TrainConfig.from_flat({"resume": "x", "data": "synthetic", "lr": 5e-4}).to_flat()["min_lr"], 5e-5)


def test_export_target_checked_before_the_first_step(src, tmp_path, capsys):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    ckpt = tmp_path / "ckpt"
    argv = ["run", "--resume", str(src), "--data", "synthetic", "--steps", "2", "--seq-len", "16", "--gbs", "2",
            "--checkpoint-dir", str(ckpt)]
    assert main([*argv, "--export-hf", str(foreign)]) == 1
    err = capsys.readouterr().err
    assert err == (f"nxdtrain: error: --export-hf {foreign}: not empty and not an earlier HF export (holds todo.txt); "
                   "choose a new directory or empty this one\n")
    assert not ckpt.exists()  # refused before anything ran or was written
    (tmp_path / "file").write_text("x")
    assert main([*argv, "--export-hf", str(tmp_path / "file")]) == 1
    assert capsys.readouterr().err == (f"nxdtrain: error: --export-hf {tmp_path / 'file'}: exists and is not a "
                                       "directory; choose a new directory\n")
    # Allowed: absent, empty, or an earlier HF export (which the export replaces).
    (tmp_path / "empty").mkdir()
    preflight.check_export_target(tmp_path / "new" / "hf", "--export-hf")
    preflight.check_export_target(tmp_path / "empty", "--export-hf")
    (tmp_path / "interrupted/.ckptconv-tmp").mkdir(parents=True)  # an export cut short: the export resumes it
    preflight.check_export_target(tmp_path / "interrupted", "--export-hf")
    # nxdtrain export says the same, never "--overwrite" (a ckptconv flag nxdtrain does not have).
    assert main(["export", str(src), str(foreign)]) == 1
    err = capsys.readouterr().err
    assert err == (f"nxdtrain: error: OUT {foreign}: not empty and not an earlier HF export (holds todo.txt); "
                   "choose a new directory or empty this one\n")
    assert main(["export", str(src), str(tmp_path / "hf")]) == 0
    assert main(["export", str(src), str(tmp_path / "hf")]) == 0  # an earlier HF export is replaced
    assert "--overwrite" not in capsys.readouterr().err


def test_directories_checked_for_writability(src, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainError, match=rf"^--checkpoint-dir {tmp_path}/file/ckpt: {tmp_path}/file is not a directory$"):
        prepare(config(resume=str(src), checkpoint_dir=str(tmp_path / "file/ckpt")), world_size=1)
    # This suite may run as root, for whom every directory is writable: ask the check's own question falsely.
    readonly = tmp_path / "ro"
    readonly.mkdir()
    real_access = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False if str(p) == str(readonly) else real_access(p, mode))
    with pytest.raises(TrainError, match=rf"^--checkpoint-dir {readonly}/a/b: {readonly} is not writable by this user$"):
        prepare(config(resume=str(src), checkpoint_dir=str(readonly / "a/b")), world_size=1)
    with pytest.raises(TrainError, match=rf"^--export-hf {readonly}/hf: {readonly} is not writable by this user$"):
        prepare(config(resume=str(src), checkpoint_dir=str(tmp_path / "ck"), export_hf=str(readonly / "hf")),
                world_size=1)


def fake_zero1_tag(src, tag, *, dp: int):
    """A completed tag whose optimizer state was saved with --zero1 over ``dp`` ranks (side files only)."""
    shutil.copytree(src, tag)
    (tag / "optim").mkdir()
    for rank in range(dp):
        (tag / f"optim/dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt").write_bytes(b"")
    torch.save({"step": 2, "consumed_samples": 4, "rng": [], "options": {"zero1": True}}, tag / "user_content.pt")
    torch.save({"step": 2}, tag / "scheduler.pt")
    # Recorded in ckptconv.json as a real save records them (resume checks what it reads against it).
    meta = read_metadata(tag)
    added = record_files([tag / "optim", tag / "user_content.pt", tag / "scheduler.pt"], tag, "blake3")
    meta.files.update({name: record.to_json() for name, record in added.items()})
    write_metadata(tag, meta)
    write_markers(tag)
    return tag


def test_zero1_layout_change_is_said_and_a_bad_optimizer_file_refused_once(src, tmp_path, capsys):
    """A ZeRO-1 tag of another dp size (or none) resumes, resharded on load and said before any step; optimizer
    files that are not optimizer state stop the run with one line, however many processes read them."""
    tag = fake_zero1_tag(src, tmp_path / "step_2", dp=2)
    plan = prepare(config(resume=str(tag), no_checkpoint=True), world_size=2)
    assert plan.resume_notes[0] == ("resharding on load (weights and optimizer state, each rank reads its slices of "
                                    "the tag): tp 1 pp 1 kvm 1 separate, ZeRO-1 over 2 dp ranks -> tp 1 pp 1 kvm 1 "
                                    "separate, no ZeRO-1")
    assert main(["run", "--nproc", "4", "--resume", str(tag), "--data", "synthetic", "--zero1", "--steps", "3", "--seq-len", "16",
                 "--gbs", "4", "--no-checkpoint"]) == 1
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("nxdtrain: error:")]
    assert errors == [f"nxdtrain: error: --resume {tag}: {tag}/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt: not an "
                      "optimizer file (empty file); use another tag, or --weights-only for the weights alone"], lines


def test_model_config_missing_is_said_in_nxdtrains_words(src, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(src / "model", bare / "model")
    assert main(["export", str(bare), str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (
        f"nxdtrain: error: {bare} has no ckptconv.json and no hf/config.json, so the model is unknown; "
        f"copy the HF model's config.json to {bare}/hf/config.json\n")
    with pytest.raises(TrainError, match=rf"^--resume {bare}: {bare} has no ckptconv.json"):
        prepare(config(resume=str(bare), no_checkpoint=True), world_size=1)
